"""The shape of the code, read from its source (no imports run): what a front may touch of a
session, and which module imports which (docs: /work/shared/DESIGN.md's "arrows point down").

Checked with `ast` over the files themselves, so a test fails the moment a front reaches inside a
Session again, or an import (a type-only one included) closes a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The session and its own parts: the only code that may touch what the Session keeps inside.
SESSION_FILES = {"voice/conversation/session.py", "voice/conversation/reply.py"}
SESSION_INSIDES = {"floor", "replies", "history"}  # besides every `_private` member


def _python_files(root: Path, *folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py"))


def _is_session_type(annotation: ast.expr | None) -> bool:
    """`Session`, `Session | None`, `"Session"`, `Optional[Session]`..."""
    if annotation is None:
        return False
    words = ast.unparse(annotation).replace("'", " ").replace('"', " ").replace("[", " ").replace("]", " ")
    return "Session" in words.replace("|", " ").split()


def _session_names(tree: ast.Module) -> set[str]:
    """Names that hold a Session in this module: built from `Session(...)`, annotated as one, or
    taken from the open sessions (`instance.live`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and ast.unparse(node.value.func) == "Session":
            names |= {ast.unparse(t) for t in node.targets}
        elif isinstance(node, (ast.AnnAssign, ast.arg)) and _is_session_type(node.annotation):
            names.add(ast.unparse(node.target) if isinstance(node, ast.AnnAssign) else node.arg)
        elif isinstance(node, (ast.For, ast.comprehension)) and ast.unparse(node.iter).endswith(".live"):
            names.add(ast.unparse(node.target))
    return names


def reaches_inside(root: Path) -> list[str]:
    """Every place outside the session's own files that touches a Session's `.floor`, `.replies`,
    `.history` or a `_private` member: `file:line expression`."""
    found = []
    for path in _python_files(root, "voice", "bench"):
        rel = path.relative_to(root).as_posix()
        if rel in SESSION_FILES:
            continue
        tree = ast.parse(path.read_text(), rel)
        sessions = _session_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if not (node.attr in SESSION_INSIDES or private):
                continue
            receiver = ast.unparse(node.value)
            if receiver in sessions or receiver.split(".")[-1].lower().endswith("session"):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return sorted(found, key=lambda place: (place.split(":")[0], int(place.split(":")[1].split(" ")[0])))


def test_no_front_reaches_inside_a_session():
    """A front asks the session (instruct, offer_tools, cancel_reply, heard_only, answer_in, ...);
    what the session keeps (its floor, reply runner, history, private members) is its own."""
    assert reaches_inside(ROOT) == []


def test_the_rule_sees_a_front_reaching_inside(tmp_path: Path):
    """The rule finds each way a front used to reach in (realtime.py and the one-shot requests, oneshot.py, before)."""
    front = tmp_path / "voice" / "transports" / "front.py"
    front.parent.mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    front.write_text("def f(self, instance, session: Session | None):\n"
                     "    self.session.history.system_prompt = 'x'\n"
                     "    session.floor.barge_in(0)\n"
                     "    session._on_turn([])\n"
                     "    s = Session(instance)\n"
                     "    s.replies.chat = None\n"
                     "    busy = [x.floor for x in instance.live]\n"
                     "    self.floor = 0  # a VAD's noise floor is not a session's\n")
    assert [line.split(" ")[0] for line in reaches_inside(tmp_path)] == [
        f"voice/transports/front.py:{n}" for n in (2, 3, 4, 6, 7)]


def import_graph(root: Path, *packages: str) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports, type-only imports (`if TYPE_CHECKING:`) and
    imports inside functions included: an arrow is an arrow, whenever it is followed."""
    modules: dict[str, Path] = {}
    for path in _python_files(root, *packages):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:  # the longest module name it starts with (`from voice.pipeline import vad`)
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    imported.add(target)
        graph[name] = imported
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: its strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_circles():
    """voice/: session -> reply -> modes -> limits -> calllog -> stages -> session was one circle,
    closed by type-only imports; the parts now get their collaborators and the shared types sit
    lower. engine/: runtime, model, llamacpp -> decode (CacheState, Forward) -> them was another;
    the cache and the forward are the seam's own types now (engine/runtime.py)."""
    assert circles(import_graph(ROOT, "voice")) == []
    assert circles(import_graph(ROOT, "engine")) == []


def test_circles_are_found(tmp_path: Path):
    """The check sees a circle closed only by a type-only import, and a relative one."""
    package = tmp_path / "voice"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from voice.b import B\n")
    (package / "b.py").write_text("from . import a\n")
    (package / "c.py").write_text("import voice.a\n")
    assert circles(import_graph(tmp_path, "voice")) == [["voice.a", "voice.b"]]



def feature_probes(root: Path) -> list[str]:
    """`getattr(x, "name", default)` / `hasattr(x, "name")` on a stage or the service's context, a
    private member of one, and `isinstance(..., LocalLM | RemoteLM)`, in production code: what a
    Protocol should say instead."""
    holders = ("instance", "lm", "synthesizer", "whisper", "model", "session")
    found = []
    for path in _python_files(root, "voice"):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and ast.unparse(node.value).split(".")[-1].lstrip("_") in holders:  # a stage's private member
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
                continue
            subject = ast.unparse(node.args[0])
            probe = node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and subject.split(".")[-1].lstrip("_") in holders
            concrete = node.func.id == "isinstance" and len(node.args) == 2 \
                and any(name in ast.unparse(node.args[1]) for name in ("LocalLM", "RemoteLM"))
            if probe or concrete:
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return found


def test_stages_are_asked_through_their_protocols():
    """What the service needs of its LM, synthesizer and ASR is a Protocol (voice/pipeline/lm.py, tts.py,
    asr.py): no feature probes, no type checks on a concrete LM, no private calls from outside."""
    assert feature_probes(ROOT) == []


def test_the_fakes_implement_the_protocols():
    """Tests' stand-ins have every member the Protocol names (what production code may call)."""
    from fakes import FakeLM, FakeSynth, FakeWhisper

    from voice.pipeline.asr import Transcriber
    from voice.pipeline.lm import LanguageModel
    from voice.pipeline.tts import SpeechSynthesizer

    for protocol, fake in ((LanguageModel, FakeLM()), (SpeechSynthesizer, FakeSynth()), (Transcriber, FakeWhisper())):
        members = {n for n in (*vars(protocol), *protocol.__annotations__) if not n.startswith("_")}
        assert members and [m for m in sorted(members) if not hasattr(fake, m)] == [], protocol.__name__
