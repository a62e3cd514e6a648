"""The engine kit: pieces every engine needs the same way, kept here once (issue 26)."""
