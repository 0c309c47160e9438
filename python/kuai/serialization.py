"""kuai.save / kuai.load: objects of tensors and plain values in one safetensors file.

``kuai.save(obj, path)`` takes a tensor, or dicts, lists and tuples of tensors and plain values
(int, float, str, bool, None): a model's ``state_dict()``, or a full checkpoint such as
``{"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
"loader": loader.state_dict(), "step": step}``. The tensors are stored under their paths joined
with "." (a flat state dict keeps its own names, so the file is an ordinary safetensors file that
any reader loads); the tree around them goes into the header's metadata as JSON ("kuai.tree"),
with the xxh3 of every tensor's bytes ("kuai.checksums"). The file is written to ``path.tmp``,
fsynced and renamed, so a crash mid-save leaves the previous file intact.

``kuai.load(path)`` validates the file (structure, then every checksum; errors name the file and
the check) and gives back the same tree, tensors on the CPU. A safetensors file that kuai did not
write loads as a dict of its tensors.
"""

import json
import os

from kuai._kuai import Tensor, __version__
from kuai._kuai import io as _io

_FORMAT = "kuai.save"


def _encode(obj, path, tensors, seen):
    if isinstance(obj, Tensor):
        key = path or "tensor"
        if key in seen:
            raise ValueError(f"kuai.save: two tensors would be stored as '{key}'")
        seen.add(key)
        tensors.append((key, obj))
        return {"__tensor__": key}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"kuai.save: dict key {k!r} at '{path}' is not a str or an int")
            sub = f"{path}.{k}" if path else str(k)
            items.append([k, _encode(v, sub, tensors, seen)])
        return {"__dict__": items}
    if isinstance(obj, (list, tuple)):
        kind = "__list__" if isinstance(obj, list) else "__tuple__"
        return {kind: [_encode(v, f"{path}.{i}" if path else str(i), tensors, seen)
                       for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"kuai.save: cannot store a {type(obj).__name__} (at '{path or '<root>'}'); "
                    "tensors, dicts, lists, tuples, int, float, str, bool and None can be stored")


def _decode(node, tensors):
    if isinstance(node, dict):
        if "__tensor__" in node:
            return tensors[node["__tensor__"]]
        if "__dict__" in node:
            return {k: _decode(v, tensors) for k, v in node["__dict__"]}
        if "__list__" in node:
            return [_decode(v, tensors) for v in node["__list__"]]
        if "__tuple__" in node:
            return tuple(_decode(v, tensors) for v in node["__tuple__"])
        raise ValueError(f"unknown node {sorted(node)}")
    return node


def save(obj, f):
    """Writes obj (a tensor, or a tree of them and plain values) to the safetensors file f."""
    path = os.fspath(f)
    tensors = []
    tree = _encode(obj, "", tensors, set())
    metadata = {
        "kuai.format": _FORMAT,
        "kuai.version": __version__,
        "kuai.tree": json.dumps(tree, separators=(",", ":")),
        "kuai.checksums": json.dumps({k: _io.checksum(t) for k, t in tensors},
                                     separators=(",", ":")),
    }
    _io.save_file(path, tensors, metadata)


def load(f, map_location=None, weights_only=True):
    """Reads what save() wrote (checked) and returns it; tensors are CPU tensors."""
    path = os.fspath(f)
    if map_location not in (None, "cpu"):
        raise ValueError(f"kuai.load: map_location {map_location!r}: kuai loads to the cpu")
    pairs, metadata = _io.load_file(path)
    tensors = dict(pairs)
    if metadata.get("kuai.format") != _FORMAT:
        return tensors  # an ordinary safetensors file
    try:
        checksums = json.loads(metadata["kuai.checksums"])
        tree = json.loads(metadata["kuai.tree"])
    except (KeyError, json.JSONDecodeError) as e:
        raise RuntimeError(f"{path}: kuai metadata is unreadable ({e})") from None
    for name, want in checksums.items():
        if name not in tensors:
            raise RuntimeError(f"{path}: tensor '{name}' named by the checksums is missing")
        got = _io.checksum(tensors[name])
        if got != want:
            raise RuntimeError(f"{path}: tensor '{name}' fails its checksum "
                               f"(stored {want}, data {got})")
    extra = set(tensors) - set(checksums)
    if extra:
        raise RuntimeError(f"{path}: tensors without a checksum: {sorted(extra)[:4]}")
    try:
        return _decode(tree, tensors)
    except (KeyError, ValueError, TypeError) as e:
        raise RuntimeError(f"{path}: kuai.tree does not match the tensors ({e})") from None
