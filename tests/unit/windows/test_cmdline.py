"""The command-line splitter the service tests rely on reproduces Microsoft's documented examples."""

import pytest

from tests.unit.windows.cmdline import split

# The examples table of Microsoft's "Parsing C++ command-line arguments".
DOCUMENTED = [
    ('"abc" d e', ["abc", "d", "e"]),
    (r"a\\b d\"e f\"g h", [r"a\\b", 'd"e', 'f"g', "h"]),
    (r"a\\\"b c d", [r"a\"b", "c", "d"]),
    (r'a\\\\"b c" d e', [r"a\\b c", "d", "e"]),
    ('a"b"" c d', ['ab" c d']),
]


@pytest.mark.parametrize(("line", "argv"), DOCUMENTED)
def test_documented_examples(line, argv):
    assert split(line) == argv


def test_empty_quoted_argument_survives():
    assert split('a "" b') == ["a", "", "b"]
