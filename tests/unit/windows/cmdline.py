"""Windows command-line splitting as the Microsoft C runtime does it for main(argc, argv) (VS 2008 and later).

llama-server.exe is a C++ program: the command line WinSW hands to CreateProcess is split by these rules.
"""

from __future__ import annotations


def split(cmdline: str) -> list[str]:
    args: list[str] = []
    i, n = 0, len(cmdline)
    while True:
        while i < n and cmdline[i] in " \t":
            i += 1
        if i >= n:
            return args
        arg: list[str] = []
        quoted = False
        while i < n:
            char = cmdline[i]
            if char in " \t" and not quoted:
                break
            if char == "\\":
                j = i
                while j < n and cmdline[j] == "\\":
                    j += 1
                count = j - i
                if j < n and cmdline[j] == '"':
                    arg.append("\\" * (count // 2))
                    if count % 2:  # an odd run escapes the quote
                        arg.append('"')
                        j += 1
                    i = j
                else:  # backslashes not before a quote are literal
                    arg.append("\\" * count)
                    i = j
                continue
            if char == '"':
                if quoted and i + 1 < n and cmdline[i + 1] == '"':
                    arg.append('"')  # "" inside quotes is a literal quote
                    i += 2
                else:
                    quoted = not quoted
                    i += 1
                continue
            arg.append(char)
            i += 1
        args.append("".join(arg))
