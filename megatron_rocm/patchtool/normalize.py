"""Give every diff in a series its ``git am`` mail header (see ``diffio``), byte-stably.

Run after adding or hand-editing patches::

    python3 -m megatron_rocm.patchtool.normalize            # the checkout's patches/
    python3 -m megatron_rocm.patchtool.normalize DIR --check  # exit 1 if a file would change

Only the header changes: the diff itself is kept byte for byte, so what applies where is the
same before and after. Running it twice changes nothing the second time.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_rocm.errors import EXIT_FAILED, EXIT_OK
from megatron_rocm.patchtool import diffio
from megatron_rocm.patchtool.series import Series, load_series


def pending(series: Series) -> list[tuple[Path, bytes]]:
    """(diff file, normalised bytes) for each file whose bytes would change."""
    out = []
    for patch in series.patches:
        for variant in patch.variants:
            if variant.skip:
                continue
            path = patch.diff_path(variant)
            diffio.load(path, patch.id)  # refuses a corrupt diff or a header naming another id
            old = path.read_bytes()
            new = diffio.render(patch.id, patch.reason, old)
            if new != old:
                out.append((path, new))
    return out


def normalize(series_dir: str | None, check: bool = False) -> int:
    series = load_series(series_dir)
    changes = pending(series)
    for path, data in changes:
        if check:
            print(f"not normalised: {path}")
        else:
            path.write_bytes(data)
            print(f"normalised {path}")
    verb = "need" if check else "got"
    print(f"{len(changes)} diff files {verb} a new header in {series.folder}")
    return EXIT_FAILED if check and changes else EXIT_OK


if __name__ == "__main__":
    from megatron_rocm.commands.normalize import main

    sys.exit(main())
