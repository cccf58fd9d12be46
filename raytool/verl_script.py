"""The hydra overrides of a verl run script, read without running it.

A verl run script is a bash file that sets shell variables and ends in
`python3 -m verl.trainer.main_ppo key=value ...` (or `recipe.<name>.main_<x>`, or `torchrun ... -m
verl.trainer.fsdp_sft_trainer`). `read_verl_script` follows the script the way bash would, line by
line: assignments and `export`/`declare` set variables; `$X`, `${X}`, `${X:-d}`, `${X-d}`, `${X:=d}`,
`${X=d}`, `${X:+d}`, `$1`, `$#`, `$@`, `$*` and integer `$(( ))` arithmetic are expanded; quotes and
word splitting follow bash; every other command (`set -x`, `ulimit`, `pip install`, `cd`, ...) is
skipped. Nothing is executed: a command substitution (`$(...)` or backticks) is kept as written,
and each such thing is named in `VerlCommand.unresolved`.

The environment is `env` alone (empty by default, never `os.environ`), so `$PWD` and `$HOME` are
what the caller passes; the CLI passes the user's. An unset variable expands to empty, as in bash,
and is named in `unresolved`. `args` stand for the script's arguments (`$@`), each one word.
Hydra's `+key`/`++key` give `key`; `--config-path`/`--config-name` are named in `unresolved`.
Not handled: control flow (`if`, `for`; functions are never called; every branch's assignments
count), arrays, `~`, globbing (a pattern stays literal, as in bash when nothing matches), `$'..'`,
here-docs, `source`, and parameter forms other than those above (kept as written, in `unresolved`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

_UNIT = re.compile(r"'[^']*'|`(?:\\.|[^`\\])*`|\$(?:[A-Za-z_][A-Za-z0-9_]*|[0-9@*#?$!-])|\\.|.", re.S)
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_PARAM = re.compile(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#])(?:(:?[-=+])(.*))?\Z", re.S)
_REDIRECT = re.compile(r"(?:[0-9]+|&)?(?:>>|>&|<&|>|<)")
_LAUNCHER = re.compile(r"(?:python[0-9.]*|torchrun)\Z")
_MODULE = re.compile(r"(?:verl|recipe)\.[\w.]+\Z")
_DECLARE = {"export", "declare", "typeset", "local", "readonly"}
_ALL_ARGS = {"$@", '"$@"', "${@}", '"${@}"'}
_CONFIG_FLAGS = {
    **dict.fromkeys(("--config-path", "-cp", "--config-dir", "-cd"), "a hydra config directory; its files are not read"),
    **dict.fromkeys(("--config-name", "-cn"), "a hydra config file; its keys are not read"),
}


def _quotient(a: int, b: int) -> int:
    """a / b as bash computes it: truncated toward zero."""
    return abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)


_ARITH_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: _quotient,
    ast.Mod: lambda a, b: a - b * _quotient(a, b),
}


@dataclass
class VerlCommand:
    """The verl command of a script: its module and overrides (key, value, line), and what was not evaluated."""

    module: str
    overrides: list[tuple[str, str, int]]
    unresolved: list[str]
    launcher: list[str] = field(default_factory=list)  # the words before `-m` (torchrun's --nnodes, --nproc_per_node)


class VerlScriptError(ValueError):
    """A script that cannot be read as a verl run script; the message names the file (and line)."""


@dataclass
class _Word:
    """One shell word as written, the line it starts on, and whether it is a redirection operator."""

    raw: str
    line: int
    redirect: bool = False


class _Unclosed(Exception):
    """A quote or expansion that the text does not close: (offset, what)."""


class _NotArith(Exception):
    """An arithmetic expression outside integer + - * / % and parentheses."""


def read_verl_script(path: str | Path, args: Sequence[str] = (), env: dict[str, str] | None = None) -> VerlCommand:
    """The verl command of the script at `path` (see `parse_verl_script`)."""
    return parse_verl_script(Path(path).read_text(encoding="utf-8"), str(path), args, env)


def parse_verl_script(
    text: str, source: str = "script", args: Sequence[str] = (), env: dict[str, str] | None = None
) -> VerlCommand:
    """The verl command of script `text`, with `args` as `$@` and `env` (default empty) as the environment.

    Of several verl commands, the last `verl.trainer.main_ppo` or `recipe.*.main*` one, else the last.
    """
    try:
        commands = _lex(text)
    except _Unclosed as exc:
        pos, what = exc.args
        raise VerlScriptError(f"{source}: line {_line(text, pos)}: {what} is not closed") from None
    shell = _Shell(source, args, env or {})
    found = [cmd for words in commands if (cmd := shell.run(words)) is not None]
    if not found:
        raise VerlScriptError(f"{source}: no `python -m verl.*` or `python -m recipe.*` command found")
    mains = [c for c in found if c.module == "verl.trainer.main_ppo" or re.match(r"recipe\..*\.main", c.module)]
    return (mains or found)[-1]


def _line(text: str, pos: int) -> int:
    """The 1-based line number of offset `pos`."""
    return text.count("\n", 0, pos) + 1


def _lex(text: str) -> list[list[_Word]]:
    """The script's simple commands, each a list of words as written (comments and continuations removed)."""
    commands: list[list[_Word]] = [[]]
    start: int | None = None
    i = 0
    while i < len(text):
        c = text[i]
        redirect = _REDIRECT.match(text, i) if start is None or c in "<>" else None
        if redirect or c in " \t\n;|&":
            if start is not None:
                commands[-1].append(_Word(text[start:i], _line(text, start)))
                start = None
            if redirect:
                commands[-1].append(_Word(redirect.group(), _line(text, i), redirect=True))
                i = redirect.end()
                continue
            if c not in " \t" and commands[-1]:
                commands.append([])
            i += 1
        elif c == "#" and start is None:
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif text.startswith("\\\n", i) and start is None:
            i += 2
        else:
            start = i if start is None else start
            i = _end(text, i)
    if start is not None:
        commands[-1].append(_Word(text[start:], _line(text, start)))
    return [words for words in commands if words]


def _end(text: str, i: int) -> int:
    """The offset after the unit at `i`: a quoted string, a `$` form, a backtick substitution, an escape or a character."""
    c = text[i]
    if c != '"' and not text.startswith(("$(", "${"), i):
        m = _UNIT.match(text, i)
        if c in "'`" and m.end() == i + 1:
            raise _Unclosed(i, "a single quote" if c == "'" else "a backtick")
        return m.end()
    open_ = '"' if c == '"' else text[i + 1]
    close = {'"': '"', "(": ")", "{": "}"}[open_]
    j, depth = i + (1 if c == '"' else 2), 1
    while depth:
        if j >= len(text):
            raise _Unclosed(i, "a double quote" if c == '"' else f"`${open_}`")
        ch = text[j]
        depth += (ch == open_ and c != '"') - (ch == close)
        j = j + 1 if ch in (open_, close) or (ch == "'" and c == '"') else _end(text, j)
    return j


class _Fields:
    """The words one shell word expands to, built piece by piece with bash's word splitting."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.buf, self.has = "", False

    def add(self, text: str) -> None:
        """Append text to the current word (which then exists, even if empty)."""
        self.buf, self.has = self.buf + text, True

    def cut(self) -> None:
        """End the current word, if any."""
        if self.has:
            self.out.append(self.buf)
        self.buf, self.has = "", False

    def split(self, value: str) -> None:
        """Append an unquoted expansion, split at whitespace."""
        if value[:1].isspace():
            self.cut()
        self.many(value.split())
        if value[-1:].isspace():
            self.cut()

    def many(self, values: list[str]) -> None:
        """Append several words (as `$@` does): the first joins the current word, the last stays open."""
        for k, value in enumerate(values):
            if k:
                self.cut()
            self.add(value)


class _Shell:
    """Variables and arguments of a script being followed, and notes on what was not evaluated."""

    def __init__(self, source: str, args: Sequence[str], env: dict[str, str]) -> None:
        self.source, self.args, self.vars = source, list(args), dict(env)
        self.notes: list[str] = []

    def run(self, words: list[_Word]) -> VerlCommand | None:
        """Follow one command: set variables, or return it if it runs a verl module."""
        words = [w for k, w in enumerate(words) if not w.redirect and not (k and words[k - 1].redirect)]
        n = next((k for k, w in enumerate(words) if not _ASSIGN.match(w.raw)), len(words))
        if n == len(words) or words[n].raw in _DECLARE:
            for w in words[:n] if n == len(words) else words[n + 1 :]:
                if _ASSIGN.match(w.raw):
                    name, raw = w.raw.split("=", 1)
                    self.vars[name] = " ".join(self.fields(raw, w.line, split=False))
            return None
        global_notes, expanded = self.notes, []
        for w in words[n:]:
            self.notes = []
            expanded += [(text, w.line, self.notes) for text in self.fields(w.raw, w.line)]
        self.notes = global_notes
        for j, (text, _, _) in enumerate(expanded[:-1]):
            launched = any(_LAUNCHER.match(t.rsplit("/", 1)[-1]) for t, _, _ in expanded[:j])
            if text == "-m" and launched and _MODULE.match(expanded[j + 1][0]):
                return self._command(expanded[j + 1][0], expanded[j + 2 :], [t for t, _, _ in expanded[:j]])
        return None

    def _command(self, module: str, tokens: list[tuple[str, int, list[str]]], launcher: list[str]) -> VerlCommand:
        """The verl command of `module` given the expanded words after it (and `launcher`'s before `-m`)."""
        notes, overrides, k = list(self.notes), [], 0
        while k < len(tokens):
            text, line, word_notes = tokens[k]
            k += 1
            notes += [note for note in word_notes if note not in notes]
            key, eq, value = text.partition("=")
            if key in _CONFIG_FLAGS:
                if not eq and k < len(tokens):
                    value, k = tokens[k][0], k + 1
                notes.append(f"line {line}: {key}={value}: {_CONFIG_FLAGS[key]}")
            elif text.startswith("-") or not eq or not key.lstrip("+"):
                notes.append(f"line {line}: {text}: not a key=value override; ignored")
            else:
                overrides.append((key.lstrip("+"), value, line))
        return VerlCommand(module, overrides, notes, launcher)

    def _note(self, line: int, text: str) -> None:
        """Record that something on `line` was not evaluated."""
        if f"line {line}: {text}" not in self.notes:
            self.notes.append(f"line {line}: {text}")

    def fields(self, raw: str, line: int, split: bool = True) -> list[str]:
        """The words `raw` expands to: quotes removed, `$` forms expanded, split unless `split` is False."""
        if raw in _ALL_ARGS:
            return list(self.args)
        f, dq, i = _Fields(), False, 0
        while i < len(raw):
            c = raw[i]
            if c == "\\":
                nxt = raw[i + 1 : i + 2]
                f.add("" if nxt == "\n" else "\\" + nxt if dq and nxt not in '$`"\\' else nxt)
                i += 2
            elif c == "'" and not dq:
                end = raw.index("'", i + 1)
                f.add(raw[i + 1 : end])
                i = end + 1
            elif c == '"':
                dq = not dq
                f.add("")
                i += 1
            elif c.isspace() and split and not dq:
                f.cut()
                i += 1
            elif c in "$`":
                end = _end(raw, i)
                value = self._dollar(raw[i:end], line, dq)
                if isinstance(value, list):
                    f.many(value)
                elif dq or not split:
                    f.add(value)
                else:
                    f.split(value)
                i = end
            else:
                f.add(c)
                i += 1
        f.cut()
        return f.out

    def _dollar(self, piece: str, line: int, quoted: bool) -> str | list[str]:
        """The value of one `$` form or backtick substitution; a list stands for words not to be split."""
        if piece == "$":
            return "$"
        if piece.startswith("$((") and piece.endswith("))"):
            expression = " ".join(self.fields(piece[3:-2], line, split=False)).strip()
            try:
                return str(self._arith(ast.parse(expression, mode="eval").body, line))
            except (SyntaxError, RecursionError, _NotArith):
                self._note(line, f"{piece} is not integer + - * / % arithmetic; kept as written")
                return [piece]
        if piece.startswith(("`", "$(")):
            self._note(line, f"{piece} is a command substitution; kept as written")
            return [piece]
        m = _PARAM.match(piece[2:-1] if piece.startswith("${") else piece[1:])
        if not m:
            self._note(line, f"{piece} is not a supported expansion; kept as written")
            return [piece]
        name, op, word = m.groups()
        if name in ("@", "*"):
            return " ".join(self.args) if quoted and name == "*" else list(self.args)
        value = self._get(name)
        if op is None:
            if value is None:
                self._note(line, f"${name} is not set; expanded to empty")
            return value or ""
        empty = value is None or (op[0] == ":" and not value)
        if op[-1] == "+" and empty:
            return ""
        if op[-1] != "+" and not empty:
            return value
        if op[-1] == "=":
            self.vars[name] = " ".join(self.fields(word, line, split=False))
            return self.vars[name]
        return " ".join(self.fields(word, line, split=False)) if quoted else self.fields(word, line)

    def _get(self, name: str) -> str | None:
        """The value of a variable or positional parameter, None if unset."""
        if name == "#":
            return str(len(self.args))
        if name.isdigit():
            n = int(name)
            return self.source if n == 0 else self.args[n - 1] if n <= len(self.args) else None
        return self.vars.get(name)

    def _arith(self, node: ast.AST, line: int) -> int:
        """The integer value of an arithmetic expression's syntax tree (names are variables, unset is 0)."""
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in self.vars:
                self._note(line, f"{node.id} is not set; counted as 0")
            value = (self.vars.get(node.id) or "0").strip()
            if not re.fullmatch(r"[-+]?[0-9]+", value):
                raise _NotArith(node.id)
            return int(value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            value = self._arith(node.operand, line)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            left, right = self._arith(node.left, line), self._arith(node.right, line)
            if isinstance(node.op, (ast.Div, ast.Mod)) and right == 0:
                raise _NotArith("division by zero")
            return _ARITH_OPS[type(node.op)](left, right)
        raise _NotArith(type(node).__name__)
