"""The safe functions of emm's public API (and of driver-sys, which emm re-exports) that take a raw address, size-bearing pointer or
driver handle from their caller (a `DevicePtr`, a `StreamHandle` or any other driver handle,
a raw pointer), one per line, from rustdoc's JSON (nightly). Such a function must check what
it is given before the driver sees it, or take it only from emm's own values, or be `unsafe`
with a `# Safety` contract (emm/IMPLEMENTATION.md, "What safe code can reach"). The list is
kept in `emm/raw-inputs.txt`, so that a new one is seen in review; `.ci/run` fails when the
list is stale.

    python3 ci/raw_inputs.py            # prints the list
    python3 ci/raw_inputs.py --write    # writes emm/raw-inputs.txt
    python3 ci/raw_inputs.py --check    # fails when emm/raw-inputs.txt differs
"""

from rustdoc_lists import kind_of, rustdoc_json, write_or_check

# What a caller can make up: the driver's handles and raw addresses.
RAW = {"DevicePtr", "StreamHandle", "ContextHandle", "EventHandle", "GraphHandle",
       "GraphExecHandle", "ModuleHandle", "FunctionHandle", "MemPoolHandle", "HostPtr",
       "IpcMemHandle", "IpcEventHandle"}


# Trait impls that compare or copy values and reach no driver.
COMPARISONS = {"Ord", "PartialOrd", "PartialEq", "Eq", "Hash", "Clone", "Debug"}


def raw_in(ty):
    """The raw types a parameter's type names (a raw pointer as `*ptr`)."""
    found = set()
    if isinstance(ty, dict):
        if "raw_pointer" in ty:
            found.add("*ptr")
        rp = ty.get("resolved_path")
        if rp is not None and rp["path"].split("::")[-1] in RAW:
            found.add(rp["path"].split("::")[-1])
        for v in ty.values():
            found |= raw_in(v)
    elif isinstance(ty, list):
        for v in ty:
            found |= raw_in(v)
    return found


def check_fn(item, path, out):
    f = item["inner"]["function"]
    if f["header"]["is_unsafe"]:
        return
    raws = []
    for name, ty in f["sig"]["inputs"]:
        r = raw_in(ty)
        if r:
            raws.append(f"{name}: {', '.join(sorted(r))}")
    if raws:
        out.add((path.split("::")[0].lstrip("<"), item["id"], f"{path}({'; '.join(raws)})"))


def methods(type_item, path, out):
    inner = type_item["inner"][kind_of(type_item)]
    for impl_id in inner.get("impls", []):
        impl = index.get(str(impl_id))
        if impl is None:
            continue
        imp = impl["inner"]["impl"]
        if imp.get("is_synthetic") or imp.get("blanket_impl") is not None:
            continue
        trait = imp.get("trait")
        if trait is not None and trait["path"].split("::")[-1] in COMPARISONS:
            continue
        for mid in imp["items"]:
            m = index.get(str(mid))
            if m is None or kind_of(m) != "function":
                continue
            if trait is None and m["visibility"] != "public":
                continue
            where = f"{path}::{m['name']}" if trait is None else f"<{path} as {trait['path']}>::{m['name']}"
            check_fn(m, where, out)


def walk(module_id, path, seen, out):
    if module_id in seen:
        return
    seen = seen | {module_id}
    for child in index[str(module_id)]["inner"]["module"]["items"]:
        item = index.get(str(child))
        if item is None or item["visibility"] != "public":
            continue
        if kind_of(item) == "use":
            use = item["inner"]["use"]
            target_item = index.get(str(use["id"])) if use["id"] is not None else None
            if target_item is None:
                continue
            name = use["name"]
            item, child = target_item, use["id"]
        else:
            name = item["name"]
        kind = kind_of(item)
        here = f"{path}::{name}"
        if kind == "module":
            walk(child, here, seen, out)
        elif kind == "function":
            check_fn(item, here, out)
        elif kind in ("struct", "enum"):
            methods(item, here, out)
        elif kind == "trait":
            for mid in item["inner"]["trait"]["items"]:
                m = index.get(str(mid))
                if m is not None and kind_of(m) == "function":
                    check_fn(m, f"{here}::{m['name']}", out)


found = set()
# emm, and the driver trait it re-exports (`emm::driver_sys`, reachable through
# `Runtime::driver`).
for package, crate in (("emm", "emm"), ("driver-sys", "driver_sys")):
    doc = rustdoc_json(package, crate)
    index = doc["index"]
    walk(doc["root"], crate, frozenset(), found)
# An item reachable by several paths is listed once, by its shortest (the first in order
# among equals).
by_item = {}
for crate_id, item_id, line in found:
    by_item.setdefault((crate_id, item_id), []).append(line)
lines = sorted(min(v, key=lambda l: (len(l), l)) for v in by_item.values())
text = (
    "# Safe public functions of emm that take a raw address or driver handle from their caller:\n"
    "# written by `python3 ci/raw_inputs.py --write`; `.ci/run` checks it. Each must check what\n"
    "# it is given before the driver sees it (emm/IMPLEMENTATION.md, \"What safe code can reach\").\n"
    + "\n".join(lines) + "\n"
)
write_or_check(
    "emm/raw-inputs.txt", text,
    "a safe public function of emm takes a raw address or handle that it did not before (or "
    "no longer does): check that it validates what it is given or make it unsafe with a "
    "# Safety contract, then run `python3 ci/raw_inputs.py --write` and commit "
    "emm/raw-inputs.txt",
)
