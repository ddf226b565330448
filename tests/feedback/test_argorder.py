"""The argument-order check (feedback/argorder.py): calls against the definitions they reach, across files.

Small packages written here; each case is a defect a reviewer would call a swap, or a call that only looks
like one (the same value twice, a coincidence of names, another library's function of the same name).
"""

from __future__ import annotations

import pathlib
import shutil
import textwrap

from feedback.checks import run_check
from feedback.manifest import load_manifest
from feedback.models import Status
from feedback.runner import Runner

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def _sites(root: pathlib.Path, paths=("pkg",)):
    metric, n, sites = run_check("argument_order", root, list(paths))
    assert metric == "misplaced_arguments" and n == len([s for s in sites if "does not parse" not in s.message])
    return sites


RECORD = """
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class Result:
    first: int
    rid: int
    timing: float
    kind: ClassVar[str] = "result"
    extra: list = field(default_factory=list)
"""

USERS = """
from pkg.records import Result


def finish(rid, first, timing, out):
    out.append(Result(rid, first, timing))


def forward(msg, out):
    out.append(Result(msg.rid, msg.first, msg.timing))
"""


def test_a_record_whose_every_caller_disagrees_is_blamed_at_its_declaration(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/records.py": RECORD, "pkg/users.py": USERS})
    sites = _sites(root)
    assert len(sites) == 1
    (site,) = sites
    assert (site.file, site.line, site.symbol) == ("pkg/records.py", RECORD.splitlines().index("class Result:") + 1,
                                                   "Result")
    assert "declares (first, rid, timing, extra)" in site.message and "pkg/users.py:6" in site.message
    assert "pkg/users.py:10" in site.message and "odd one out" in site.message
    # the declaration in the order its callers use: nothing to say
    in_order = RECORD.replace("    first: int\n    rid: int\n", "    rid: int\n    first: int\n")
    (root / "pkg/records.py").write_text(in_order)
    assert _sites(root) == []


KERNELS = """
import triton
import triton.language as tl


@triton.jit
def attend(q_ptr, k_ptr, o_ptr, N: tl.constexpr):
    pass


def launch(q_ptr, k_ptr, o_ptr):
    attend[(1,)](q_ptr, k_ptr, o_ptr, N=16)


def launch_swapped(q_ptr, k_ptr, o_ptr):
    attend[(1,)](k_ptr, q_ptr, o_ptr, N=16)


def launch_again(q, k, o_ptr, q_ptr):
    attend[(2,)](q_ptr, k, o_ptr, N=16)
"""


def test_a_launch_that_disagrees_with_the_others_is_blamed_at_the_launch(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/kernels.py": KERNELS})
    sites = _sites(root)
    assert [(s.file, s.line, s.symbol) for s in sites] == [
        ("pkg/kernels.py", KERNELS.splitlines().index("    attend[(1,)](k_ptr, q_ptr, o_ptr, N=16)") + 1,
         "launch_swapped")]
    assert "`k_ptr` as parameter 1 (q_ptr; `k_ptr` is parameter 2)" in sites[0].message


def test_one_call_alone_names_both_places_and_methods_drop_self(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/cache.py": """
        class Cache:
            def __init__(self, pages, page_size):
                self.pages, self.page_size = pages, page_size

            def write(self, seq, slot, value):
                return seq, slot, value

            @staticmethod
            def span(start, stop):
                return stop - start
        """, "pkg/use.py": """
        from pkg.cache import Cache


        def build(page_size, pages, seq, slot, value, start, stop):
            cache = Cache(pages, page_size)
            cache.write(slot, seq, value)
            return Cache.span(start, stop)
        """})
    sites = _sites(root)
    assert [(s.file, s.symbol) for s in sites] == [("pkg/cache.py", "write"), ("pkg/use.py", "build")]
    assert "declares (seq, slot, value)" in sites[0].message and "pkg/use.py:7" in sites[0].message


def test_what_only_looks_like_a_swap_is_not_flagged(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/ops.py": """
        import torch
        from dataclasses import dataclass


        def outer(x, y):
            return x * y


        def merge(A, A2, n):
            return A + A2 + n


        def randint(high, shape):
            return torch.randint(0, high, shape)  # torch's randint, not ours


        @dataclass(kw_only=True)
        class Opts:
            b: int
            a: int


        def use(x, A_in, A, n, high, shape, a, b):
            outer(x, x)                 # one value twice
            merge(A_in, A, n)           # A is not displaced by A2's namesake: a coincidence
            Opts(a, b)                  # keyword-only fields: a call like this fails on its own
            return torch.randint(0, high, shape)
        """, "pkg/other.py": """
        from torch import randint


        def sample(shape, high):
            return randint(shape, high)  # torch's (low, high) here, whatever pkg.ops.randint declares
        """})
    assert _sites(root) == []


def test_dataclass_fields_follow_their_bases_and_two_definitions_must_both_disagree(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": """
        from dataclasses import dataclass


        @dataclass
        class Base:
            rid: int


        @dataclass
        class Child(Base):
            first: int
            last: int


        def step(src, dst):
            return src, dst
        """, "pkg/b.py": """
        def step(dst, src):
            return dst, src
        """, "pkg/c.py": """
        from pkg.a import Child, step


        def go(rid, first, last, src, dst):
            step(src, dst)  # right for one of the two definitions named step: not flagged
            ok = Child(rid, first, last)
            return ok, Child(first, rid, last)
        """})
    sites = _sites(root)
    assert len(sites) == 1 and sites[0].file == "pkg/c.py" and sites[0].symbol == "go"
    assert "declares (rid, first, last)" in sites[0].message


def test_a_file_that_does_not_parse_is_a_finding_and_the_rest_is_still_checked(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/bad.py": "def (:\n", "pkg/ok.py": """
        def pair(left, right):
            return left, right


        def use(left, right):
            return pair(right, left)
        """})
    metric, n, sites = run_check("argument_order", root, ["pkg"])
    assert n == 2 and [s.file for s in sites[:n]] == ["pkg/ok.py"] * 2  # one call: the call and the definition
    assert [s.file for s in sites[n:]] == ["pkg/bad.py"] and "does not parse" in sites[n].message


def test_the_bundled_target_passes_and_a_swapped_record_fails_at_its_declaration(tmp_path):
    """The manifest's probe, through the runner, on the bundled target and on a copy with the disaggregated
    engine's prefill-only record declared in another order than its two constructions."""
    manifest = load_manifest(ROOT, ROOT / "target_stack/infra-agent.yaml")
    spec = next(p for p in manifest.probes if p.check == "argument_order")
    runner = Runner(ROOT, manifest, use_cache=False, cache_dir=str(tmp_path / "c"))
    clean = runner.run([spec])[0]
    assert clean.status == Status.passed and clean.metrics["misplaced_arguments"].value == 0

    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "target_stack", copy / "target_stack", ignore=shutil.ignore_patterns("__pycache__"))
    messages = copy / "target_stack/engine/disagg/messages.py"
    text = messages.read_text()
    swapped = text.replace("    rid: int\n    first: int\n    timing: Timing\n",
                           "    first: int\n    rid: int\n    timing: Timing\n", 1)
    assert swapped != text
    messages.write_text(swapped)
    manifest = load_manifest(copy, copy / "target_stack/infra-agent.yaml")
    bad = Runner(copy, manifest, use_cache=False, cache_dir=str(tmp_path / "c2")).run([spec])[0]
    assert bad.status == Status.failed and bad.metrics["misplaced_arguments"].value == 1
    assert bad.findings[0].location.file == "target_stack/engine/disagg/messages.py"
    assert bad.findings[0].location.symbol == "Prefilled"


def test_an_initvar_is_a_parameter_in_its_place_and_a_classvar_is_not(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/rec.py": """
        from dataclasses import InitVar, dataclass
        from typing import ClassVar


        @dataclass
        class Scaled:
            a: int
            kind: ClassVar[str] = "scaled"
            scale: InitVar[float] = 1.0
            b: int = 0


        def make(a, scale, b):
            return Scaled(a, scale, b), Scaled(a, scale, b)


        def make_wrong(a, b, scale):
            return Scaled(a, b, scale)
        """})
    sites = _sites(root)
    assert [(s.file, s.symbol) for s in sites] == [("pkg/rec.py", "make_wrong")]
    assert "declares (a, scale, b)" in sites[0].message


def test_a_tensor_is_its_kernel_parameter_s_namesake_in_triton_s_spellings(tmp_path):
    # a kernel declares Q and K_ptr, its launches pass q and k (lightllm's `_add_in_place[grid](input, other,
    # ...)` against `(input_ptr, other_ptr, ...)`): the swap is found and named as the call writes it;
    # parameters that fold to one name (x and X_ptr) say nothing
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/k.py": """
        import triton


        @triton.jit
        def attend(Q, K_ptr, Out, n):
            pass


        @triton.jit
        def mix(x, X_ptr, n):
            pass


        def launch(q, k, out, n, x):
            attend[(1,)](q, k, out, n)
            attend[(2,)](q, k, out, n)
            attend[(3,)](k, q, out, n)
            mix[(1,)](x, x, n)
        """})
    sites = _sites(root)
    assert len(sites) == 1 and sites[0].symbol == "launch", [s.message for s in sites]
    assert "passes `k` as parameter 1 (Q; `k` is parameter 2), `q` as parameter 2 (K_ptr;" in sites[0].message


def test_a_launch_written_one_argument_a_line_is_blamed_at_the_first_moved_argument(tmp_path):
    # lightllm's launches pass one argument a line: the call starts four lines above the two that trade places
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/k.py": """
        import triton
        import triton.language as tl


        @triton.jit
        def repack(kv_index, req_index, out_index, seq_len, start_loc, BLOCK: tl.constexpr):
            pass


        def launch(kv_index, req_index, out_index, seq_len, start_loc):
            repack[(1,)](
                kv_index,
                req_index,
                out_index,
                start_loc,
                seq_len,
                BLOCK=8,
            )
        """})
    sites = _sites(root)
    text = (root / "pkg" / "k.py").read_text().splitlines()
    moved = text.index("        start_loc,") + 1
    declared = next(i for i, ln in enumerate(text, 1) if ln.startswith("def repack("))
    assert [(s.symbol, s.line) for s in sites] == [("repack", declared), ("launch", moved)], sites
    assert f"pkg/k.py:{moved}" in sites[0].message


def test_a_launch_through_wrap_triton_is_a_launch_of_the_kernel_it_wraps(tmp_path):
    # torchao launches a fifth of its kernels as torch.library.wrap_triton(kernel)[grid](...)
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/k.py": """
        import triton
        import triton.language as tl
        from torch.library import wrap_triton


        @triton.jit
        def scaled_mm(a_ptr, b_ptr, a_s, b_s, BLOCK: tl.constexpr):
            pass


        def mm(a_ptr, b_ptr, a_s, b_s):
            wrap_triton(scaled_mm)[(1,)](a_ptr, b_ptr, b_s, a_s, BLOCK=8)
        """})
    sites = _sites(root)
    assert [s.symbol for s in sites] == ["scaled_mm", "mm"], sites
    assert "passes `b_s` as parameter 3 (a_s" in sites[1].message


FLASH = '''
import triton


@triton.jit
def _fwd_kernel(Q, K, V, sm_scale, Out, N):
    pass


def flash(q, k, v, sm_scale, o, n):
    _fwd_kernel[(1,)](q, {order}, sm_scale, o, n)
'''
PIECEWISE = '''
import triton


@triton.jit
def _fwd_kernel(Q1, K1, Q2, K2, V, sm_scale, Out, N):
    pass


def piecewise(q1, k1, q2, k2, v, sm_scale, o, n):
    _fwd_kernel[(1,)](q1, k1, q2, k2, v, sm_scale, o, n)
'''


def test_a_launch_is_judged_against_its_own_module_s_kernel_not_another_of_the_same_name(tmp_path):
    # FlagAttention: flash.py's k/v swap at its `_fwd_kernel` launch was vetoed by piecewise.py's `_fwd_kernel`
    # (Q1, K1, Q2, K2, V, ...), against which the same call is no swap; the call never reaches that one
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/flash.py": FLASH.format(order="v, k"),
                            "pkg/piecewise.py": PIECEWISE})
    sites = _sites(root)
    assert sites and {s.file for s in sites} == {"pkg/flash.py"}, sites  # piecewise.py's launch is its own
    (call,) = [s for s in sites if s.symbol == "flash"]
    assert "`v` as parameter 2" in call.message


def test_a_kernel_imported_under_a_source_root_is_ours(tmp_path):
    # FlagAttention's src/ layout: `from flag_attn.split_kv import kernel` read as a third party's name, because
    # the file's path spells src.flag_attn.split_kv, and no launch of an imported kernel was judged
    root = _tree(tmp_path, {"src/mypkg/__init__.py": "", "src/mypkg/kernels.py": FLASH.format(order="k, v"),
                            "src/mypkg/split.py": "from mypkg.kernels import _fwd_kernel\n\n\n"
                                                  "def split(q, k, v, sm_scale, o, n):\n"
                                                  "    _fwd_kernel[(2,)](q, v, k, sm_scale, o, n)\n",
                            "src/mypkg/rel.py": "from .kernels import _fwd_kernel\n\n\n"
                                                "def rel(q, k, v, sm_scale, o, n):\n"
                                                "    _fwd_kernel[(3,)](q, v, k, sm_scale, o, n)\n",
                            # Liger: `Function.apply(...)` on an imported autograd class is torch's apply, not
                            # another module's function of that name
                            "src/mypkg/other.py": "def apply(weight, target):\n    return weight\n",
                            "src/mypkg/fn.py": "from mypkg import CrossEntropyFunction\n\n\n"
                                               "def loss(weight, target):\n"
                                               "    return CrossEntropyFunction.apply(target, weight)\n"})
    sites = _sites(root, paths=("src",))
    assert sorted(s.file for s in sites if s.file != "src/mypkg/kernels.py") == ["src/mypkg/rel.py",
                                                                                 "src/mypkg/split.py"], sites
