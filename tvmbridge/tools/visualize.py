"""Graphviz pictures of Relax functions and of a forward/backward split.

``visualize(fn)``: calls as boxes (op name and short attributes, small constants written into the
label), function inputs as ellipses (name, shape, dtype); one picture node per function input and
per binding. ``visualize_split(compiled)`` draws the joint (adjoint) function coloured by the split:
forward-only red, captured blue, recomputed green, backward grey, inputs white; edges carry the
bytes of the tensor they move.
"""

from __future__ import annotations

import graphviz
import tvm
from tvm import relax

from analysis.units import human_bytes

from ..partition.joint import free_vars, tensor_info, value_keys
from ..runtime.compiled import CompiledModule

COLOURS = {
    "forward": "#f4a6a6",  # red: computed in forward only
    "captured": "#9ec5f4",  # blue: kept for the backward
    "recomputed": "#a8e6a1",  # green: recomputed in the backward
    "backward": "#d0d0d0",  # grey: gradient computation
    "input": "#ffffff",
}
_SMALL = 4  # constants with at most this many elements are written into the op label


def _short_attrs(call: relax.Call) -> str:
    attrs = call.attrs
    if attrs is None:
        return ""
    parts = []
    for key in ("axes", "axis", "rate", "epsilon", "out_dtype", "keepdims"):
        try:
            v = attrs[key] if hasattr(attrs, "__getitem__") else getattr(attrs, key)
        except Exception:  # noqa: BLE001 - attrs differ per op
            continue
        if v is None:
            continue
        text = str(v)
        if isinstance(v, (list, tuple)) or hasattr(v, "__len__") and not isinstance(v, str):
            try:
                text = "[" + ",".join(str(int(a)) for a in v) + "]"
            except Exception:  # noqa: BLE001
                text = str(v)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def _const_text(c: relax.Constant) -> str | None:
    arr = c.value.numpy()
    if arr.size <= _SMALL:
        flat = arr.reshape(-1).tolist()
        return f"{flat[0]:g}" if arr.size == 1 else "[" + ",".join(f"{v:g}" for v in flat) + "]"
    return None


def _label(value: relax.Expr, keys: dict, collapse_small: bool) -> str:
    if isinstance(value, relax.Call):
        name = value.op.name.removeprefix("relax.") if hasattr(value.op, "name") else "call"
        args: list[str] = []
        for a in value.args:
            text = _const_text(a) if isinstance(a, tvm.ir.expr.Constant) and collapse_small else None
            if text is not None:
                args.append(text)
            elif isinstance(a, relax.ShapeExpr):
                args.append("(" + ",".join(str(v) for v in a.values) + ")")
            else:
                args.append("·")
        attrs = _short_attrs(value)
        return f"{name}({', '.join(args)})" + (f"\\n{attrs}" if attrs else "")
    if isinstance(value, relax.Tuple):
        return "tuple"
    if isinstance(value, relax.TupleGetItem):
        return f"getitem [{value.index}]"
    if isinstance(value, relax.Var):
        return "alias"
    return type(value).__name__


def _type_text(var: relax.Var) -> str:
    shape, dtype, _ = tensor_info(var)
    if shape is None:
        return str(var.ty)
    return f"{tuple(shape)} {dtype}"


def visualize(
    fn: relax.Function,
    node_attrs: dict[str, dict[str, str]] | None = None,
    collapse_small: bool = True,
    edge_bytes: bool = False,
) -> graphviz.Digraph:
    """A picture of a one-dataflow-block Relax function; ``node_attrs`` maps a value key (its
    name, or ``name#k`` for repeated names) to extra graphviz attributes."""
    node_attrs = node_attrs or {}
    keys = value_keys(fn)
    g = graphviz.Digraph(
        graph_attr={"rankdir": "TB", "fontsize": "10"},
        node_attr={"fontsize": "9", "style": "filled", "fillcolor": "white"},
    )
    for p in fn.params:
        k = keys[p]
        g.node(k, f"{p.name}\\n{_type_text(p)}", shape="ellipse", **node_attrs.get(k, {}))
    for b in fn.body.blocks[0].bindings:
        k = keys[b.var]
        label = f"{k} = {_label(b.value, keys, collapse_small)}\\n{_type_text(b.var)}"
        g.node(k, label, shape="box", **node_attrs.get(k, {}))
        for v in free_vars(b.value):
            if v in keys:
                attrs = {"label": human_bytes(tensor_info(v)[2]), "fontsize": "8"} if edge_bytes else {}
                g.edge(keys[v], k, **attrs)
    return g


def split_categories(compiled: CompiledModule) -> dict[str, str]:
    """Each value of the adjoint -> "input", "captured", "recomputed", "forward" or "backward"."""
    sp = compiled.split
    joint = sp.joint
    captured, recomputed = set(sp.captures), set(sp.recomputed)
    out = {}
    for k, node in joint.nodes.items():
        if node.is_param:
            out[k] = "input"
        elif k in captured:
            out[k] = "captured"
        elif k in recomputed:
            out[k] = "recomputed"
        elif node.is_forward:
            out[k] = "forward"
        else:
            out[k] = "backward"
    return out


_LEGEND = {
    "forward": "forward only",
    "captured": "kept for the backward",
    "recomputed": "recomputed in the backward",
    "backward": "gradient computation",
    "input": "input",
}


def visualize_split(compiled: CompiledModule, collapse_small: bool = True) -> graphviz.Digraph:
    """The joint function coloured by the split, edges labelled with bytes, with a legend."""
    cats = split_categories(compiled)
    attrs = {k: {"fillcolor": COLOURS[c], "tooltip": c} for k, c in cats.items()}
    graph = visualize(compiled.adjoint, attrs, collapse_small=collapse_small, edge_bytes=True)
    rows = "".join(
        f'<TR><TD BGCOLOR="{COLOURS[c]}" WIDTH="18"></TD><TD ALIGN="LEFT">{text}</TD></TR>'
        for c, text in _LEGEND.items()
    )
    graph.node(
        "legend",
        f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0">{rows}</TABLE>>',
        shape="plaintext",
        style="",
        fillcolor="white",
    )
    return graph


def draw_stage(compiled: CompiledModule, stage: str) -> graphviz.Digraph:
    """``"split"``: :func:`visualize_split`; a stage name: the main function of the Relax module
    it made; ``"stage:function"``: that function. A name that is none of these is a ``KeyError``
    whose message lists the valid ones."""
    if stage == "split":
        return visualize_split(compiled)
    modules = {k: v for k, v in compiled.stages.items() if isinstance(v, tvm.IRModule)}
    choices = {k: next(iter(m.functions)).name_hint for k, m in modules.items()}
    for k, m in modules.items():
        choices.update({f"{k}:{gv.name_hint}": gv.name_hint for gv in m.functions})
    if stage not in choices:
        raise KeyError(f"no Relax stage {stage!r}; choose split or one of {', '.join(choices)}")
    mod = modules[stage.split(":")[0]]
    return visualize(mod[choices[stage]])
