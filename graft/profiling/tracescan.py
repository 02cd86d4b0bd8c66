"""Reading a torch.profiler Chrome trace one event at a time, tolerating what torch's
export gets wrong.

torch's (kineto's) export writes each event as an indented block, one key per line::

      {
        "ph": "X",
        "cat": "user_annotation",
        "name": "say "hi"",        <- a record_function name's quotes are not escaped
        ...
        "args": {
          "External id": 1, ...
        }
      },

so a trace whose range names hold a ``"`` is not JSON, and ``json.loads`` of the whole
file both fails and needs the whole file (and several times its size) in memory.
:func:`events` reads the file line by line and yields one event dict at a time: an event
that does not parse has its one-key string lines re-escaped (a quote, a raw newline or
tab, invalid UTF-8 inside a name), then, if it still does not parse, its ``args`` dropped;
an event that cannot be read even so is skipped and counted in :class:`Problems`. Memory
stays at one event (an event block longer than :data:`MAX_EVENT_CHARS` is skipped too).

A trace not in that layout (one line of JSON, a hand-built trace) is read whole with
``json`` when it is at most :data:`MAX_WHOLE_FILE_BYTES`, else refused with a problem.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterator

MAX_EVENT_CHARS = 1 << 20  # one event block longer than this is not an event torch wrote
MAX_WHOLE_FILE_BYTES = 256 << 20

# a line holding one key and a string value: '    "name": "<anything>",'
_STRING_LINE = re.compile(r'^(\s*"[^"\\]{1,200}":\s*)"(.*)"(\s*,?\s*)$', re.S)
_STRING_START = re.compile(r'^\s*"[^"\\]{1,200}":\s*"')
_TRAILING_COMMA = re.compile(r",(\s*)\}$")


@dataclass
class Problems:
    """What reading one trace could not do: events repaired, events read without their
    ``args``, events skipped; ``examples`` keeps the first few offending lines."""
    path: str = ""
    repaired: int = 0
    args_dropped: int = 0
    skipped: int = 0
    fatal: str = ""
    examples: list = field(default_factory=list)

    def _example(self, text: str) -> None:
        if len(self.examples) < 3:
            self.examples.append(text[:200])

    def messages(self) -> list:
        out = []
        name = os.path.basename(self.path) or "the trace"
        if self.fatal:
            out.append(f"{name}: {self.fatal}")
        if self.repaired:
            out.append(f"{name}: {self.repaired} event(s) had names torch's export left unescaped "
                       "(quotes, control characters); read after re-escaping them")
        if self.args_dropped:
            out.append(f"{name}: {self.args_dropped} event(s) read without their args (not valid JSON even "
                       "after repair): their shapes and sequence numbers are missing")
        if self.skipped:
            out.append(f"{name}: {self.skipped} event(s) could not be read and were left out of the analysis "
                       f"(first: {self.examples[0] if self.examples else '?'!r})")
        return out


def _loads(text: str):
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _repair(lines: list) -> str:
    """The event's one-key string lines re-escaped (a string value that runs over several
    lines, a raw newline in a name, joined into one)."""
    out: list = []
    pending: list | None = None
    for line in lines:
        if pending is not None:
            pending.append(line)
            if line.rstrip().endswith(('"', '",')):
                out.append(_reescape("\n".join(pending)))
                pending = None
            continue
        if _STRING_START.match(line) and not line.rstrip().endswith(('"', '",')):
            pending = [line]
            continue
        out.append(_reescape(line) if _STRING_START.match(line) else line)
    if pending is not None:
        out.extend(pending)
    return "\n".join(out)


def _reescape(line: str) -> str:
    m = _STRING_LINE.match(line)
    if m is None:
        return line
    return f"{m.group(1)}{json.dumps(m.group(2), ensure_ascii=False)}{m.group(3)}"


def _without_args(lines: list) -> str:
    """The event without its ``args`` block (the lines from ``"args": {`` to its closing brace)."""
    for i, line in enumerate(lines):
        if line.lstrip().startswith('"args"') and line.rstrip().endswith("{"):
            indent = line[:len(line) - len(line.lstrip())]
            for j in range(i + 1, len(lines)):
                if lines[j].strip() in ("}", "},") and lines[j].startswith(indent) \
                        and not lines[j][len(indent):].startswith(" "):
                    kept = lines[:i] + lines[j + 1:]
                    return _TRAILING_COMMA.sub(r"\1}", "\n".join(kept).rstrip().rstrip(","))
    return ""


def _parse_block(lines: list, problems: Problems):
    text = "\n".join(lines).rstrip().rstrip(",")
    event = _loads(text)
    if event is not None:
        return event
    repaired = _repair(lines).rstrip().rstrip(",")
    event = _loads(repaired)
    if event is not None:
        problems.repaired += 1
        return event
    event = _loads(_without_args(_repair(lines).split("\n")))
    if event is not None:
        problems.args_dropped += 1
        return event
    problems.skipped += 1
    problems._example(next((l.strip() for l in lines if '"name"' in l), lines[0].strip() if lines else ""))
    return None


def events(path, problems: Problems | None = None) -> Iterator[dict]:
    """The trace's ``traceEvents``, one dict at a time (see the module's docstring)."""
    problems = problems if problems is not None else Problems()
    problems.path = str(path)
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for line in f:
            if '"traceEvents"' in line:
                rest = line.split('"traceEvents"', 1)[1].strip()
                if rest.replace(" ", "") != ":[":
                    yield from _whole_file(path, problems)
                    return
                break
        else:
            problems.fatal = "no traceEvents (not a Chrome trace)"
            return
        block: list | None = None
        indent = ""
        size = 0
        for line in f:
            line = line.rstrip("\r\n")
            if block is None:
                stripped = line.strip()
                if stripped == "{":
                    block, indent, size = [line], line[:len(line) - len(line.lstrip())], len(line)
                elif stripped.startswith("]"):
                    return
                continue
            block.append(line)
            size += len(line) + 1
            if line.strip() in ("}", "},") and line[:len(line) - len(line.lstrip())] == indent:
                event = _parse_block(block, problems)
                block = None
                if event is not None:
                    yield event
            elif size > MAX_EVENT_CHARS:
                problems.skipped += 1
                problems._example(block[0])
                block = None  # resynchronise on the next block's opening line
        if block is not None:
            problems.skipped += 1
            problems.fatal = problems.fatal or "the trace ends inside an event (truncated file)"


def _whole_file(path, problems: Problems) -> Iterator[dict]:
    size = os.path.getsize(path)
    if size > MAX_WHOLE_FILE_BYTES:
        problems.fatal = (f"not in torch's one-key-per-line layout and {size >> 20} MiB (over "
                          f"{MAX_WHOLE_FILE_BYTES >> 20} MiB): not read")
        return
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
    except (ValueError, RecursionError) as exc:
        problems.fatal = f"not valid JSON and not in torch's layout ({exc}): not read"
        return
    found = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(found, list):
        problems.fatal = "no traceEvents list (not a Chrome trace)"
        return
    for event in found:
        if isinstance(event, dict):
            yield event
        else:
            problems.skipped += 1
