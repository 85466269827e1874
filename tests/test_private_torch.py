"""Private torch APIs are used only in each package's ``_compat.py`` (CONVENTIONS; issue 25, item 2).

There every one has a fallback, tested by removing it (``tests/*/test_compat_*.py``). This scans the
package sources for private torch names outside those files: ``torch.<...>._name`` attribute
paths, imports from private torch modules or of private names, and the private attributes of
tensors and modules Merak used to read directly. nn.Module's own containers (``_parameters``,
``_buffers``, ``_modules``) are not counted: every PyTorch version has them and much of the
ecosystem reads them.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATTERNS = [
    re.compile(r"\btorch(?:\.\w+)*\._[A-Za-z]\w*"),  # torch.x._private
    re.compile(r"^\s*from\s+torch(?:\.\w+)*\s+import\s+\(?\s*_[A-Za-z]\w*", re.M),  # from torch.x import _p
    re.compile(r"^\s*(?:from|import)\s+torch(?:\.\w+)*\._\w+", re.M),  # from/import torch.x._private
    re.compile(r"\bplanner_helpers\b"),  # DCP's undocumented planner helpers (_compat.read_items_for_chunks)
    # Also inside strings (``getattr(t, "_backward_hooks", None)``): the last is matched in the raw text.
    re.compile(r"_backward_hooks\b|_non_persistent_buffers_set|_get_default_store|_compiling_state_context"),
]


def _code(text: str) -> str:
    """``text`` with its strings and comments blanked (a logger name or a docstring may name anything)."""
    lines = text.splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for row in range(r0, r1 + 1):
            line = lines[row - 1]
            start = c0 if row == r0 else 0
            end = c1 if row == r1 else len(line.rstrip("\n"))
            lines[row - 1] = line[:start] + " " * (end - start) + line[end:]
    return "".join(lines)


def _offences() -> list[str]:
    found = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        if path.name == "_compat.py":
            continue
        raw = path.read_text()
        code = _code(raw)
        for pattern in PATTERNS:
            text = raw if pattern is PATTERNS[-1] else code
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0).strip()}")
    return found


def test_private_torch_apis_only_in_compat() -> None:
    offences = _offences()
    assert not offences, (
        "private torch APIs outside _compat.py (move them there, with a fallback):\n" + "\n".join(offences)
    )


def test_the_scan_finds_a_private_use(tmp_path: Path) -> None:
    sample = (
        "import torch\nfrom torch.utils._pytree import tree_flatten\n"
        "x = torch.distributed.distributed_c10d._get_default_store()\n"
        'hooks = getattr(p, "_backward_hooks", None)  # torch._private in a comment\n'
    )
    code = _code(sample)
    hits = [m.group(0) for p in PATTERNS for m in p.finditer(sample if p is PATTERNS[-1] else code)]
    assert hits == [
        "torch.utils._pytree",
        "torch.distributed.distributed_c10d._get_default_store",
        "from torch.utils._pytree",
        "_get_default_store",
        "_backward_hooks",
    ], hits
