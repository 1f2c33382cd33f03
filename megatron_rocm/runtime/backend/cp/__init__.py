"""Context-parallel core attention: the schemes of ``--cp-comm-type`` (``dispatch`` picks one)."""
