"""Version ranges and the series catalog."""

from __future__ import annotations

import pytest
from packaging.version import Version

from megatron_rocm.errors import UsageError
from megatron_rocm.patchtool.series import Variant, load_series, release_of


@pytest.mark.parametrize(
    ("text", "release"),
    [("0.17.0rc0", "0.17.0"), ("0.19.1", "0.19.1"), ("0.20", "0.20.0"), ("1.2.3.dev4", "1.2.3")],
)
def test_release_of(text, release):
    assert release_of(text) == Version(release)


def test_variant_range_is_half_open():
    v = Variant("x.diff", Version("0.12.0"), Version("0.15.0"))
    assert v.covers(Version("0.12.0")) and v.covers(Version("0.14.9"))
    assert v.covers(Version("0.15.0rc1")) is False  # rc of 0.15 counts as 0.15
    assert not v.covers(Version("0.11.9"))


def test_bundled_series_loads_and_has_every_patch():
    series = load_series()
    ids = [p.id for p in series.patches]
    assert ids[:2] == ["legacy-fused-kernels", "fused-softmax"]
    assert len(ids) == len(set(ids)) >= 10
    for p in series.patches:
        assert p.reason and len(p.reason) <= 72, p.id
        assert any(v.covers(Version("0.12.0")) for v in p.variants), p.id
        assert any(v.covers(Version("0.20.0")) for v in p.variants), p.id


def test_missing_series_file(tmp_path):
    with pytest.raises(UsageError, match="no patch series"):
        load_series(tmp_path)


def test_duplicate_ids(tmp_path):
    (tmp_path / "series").write_text("a\na\n")
    with pytest.raises(UsageError, match="listed twice"):
        load_series(tmp_path)


@pytest.mark.parametrize("bad", ["req deps", "-x", ".hidden", "a/b", "ü"])
def test_a_patch_id_is_one_plain_word(tmp_path, bad):
    (tmp_path / "series").write_text(f"{bad}\n")
    with pytest.raises(UsageError, match="is not one word"):
        load_series(tmp_path)


@pytest.mark.parametrize("text", ["Add thing \x1b[1m", 'quote " and \\ slash', "tab\tnl\nx\x7f"])
def test_strings_written_to_patch_toml_read_back_unchanged(text):
    import tomllib

    from megatron_rocm.patchtool.series import _q

    assert tomllib.loads(f"k = {_q(text)}")["k"] == text


@pytest.mark.parametrize(
    ("line", "key"), [("since = 17", "since"), ("since = 0.14", "since"), ('since = "abc"', "since"),
                      ('since = "0.1.0"\nuntil = 1', "until")]
)  # fmt: skip
def test_a_version_that_is_not_a_quoted_version_is_bad_input_naming_file_and_key(
    tmp_path, capsys, line, key
):
    """TOML reads ``since = 17`` as an integer: it is bad input (exit 2, one line naming the
    file and the key), not a range that covers nothing, which made ``check`` exit 1 silently."""
    from megatron_rocm.main import main

    (tmp_path / "series").write_text("p\n")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "v.diff").write_text("")
    toml = tmp_path / "p" / "patch.toml"
    toml.write_text(f'id = "p"\nreason = "r"\n\n[[variant]]\ndiff = "v.diff"\n{line}\n')
    assert main(["list", "--series", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(toml) in err[0] and repr(key) in err[0], err
