"""emm's public API as a list of paths, one item per line (`kind path`), made from rustdoc's JSON
(nightly). The list is kept in `emm/public-api.txt`: a change to what embedders can reach shows
in review, and `.ci/run` fails when the list is stale.

    python3 ci/public_api.py            # prints the list
    python3 ci/public_api.py --write    # writes emm/public-api.txt
    python3 ci/public_api.py --check    # fails when emm/public-api.txt differs

Methods and trait items are not listed: their types are. Every path an item is reachable by
is listed, so an item re-exported at the crate root shows twice.
"""

from rustdoc_lists import kind_of, rustdoc_json, write_or_check

doc = rustdoc_json("emm", "emm")
index = doc["index"]
KINDS = {"struct", "enum", "trait", "function", "constant", "static", "type_alias", "macro",
         "union", "trait_alias"}
lines = set()


def walk(module_id, path, seen):
    if module_id in seen:
        return
    seen = seen | {module_id}
    for child in index[str(module_id)]["inner"]["module"]["items"]:
        item = index.get(str(child))
        if item is None or item["visibility"] != "public":
            continue
        kind = kind_of(item)
        if kind == "module":
            lines.add(f"module {path}::{item['name']}")
            walk(child, f"{path}::{item['name']}", seen)
        elif kind == "use":
            use = item["inner"]["use"]
            target_item = index.get(str(use["id"])) if use["id"] is not None else None
            if use["is_glob"]:
                if target_item is not None and kind_of(target_item) == "module":
                    walk(use["id"], path, seen)
                continue
            if target_item is None:
                lines.add(f"reexport {path}::{use['name']} ({use['source']})")
            elif kind_of(target_item) == "module":
                lines.add(f"module {path}::{use['name']}")
                walk(use["id"], f"{path}::{use['name']}", seen)
            else:
                lines.add(f"{kind_of(target_item)} {path}::{use['name']}")
        elif kind in KINDS:
            lines.add(f"{kind} {path}::{item['name']}")


walk(doc["root"], "emm", frozenset())
ordered = sorted(lines, key=lambda l: (l.split(" ", 1)[1], l))
at_root = sum(1 for l in ordered if l.split(" ", 1)[1].count("::") == 1)
text = (
    "# emm's public API: written by `python3 ci/public_api.py --write`; `.ci/run` checks it.\n"
    f"# {len(ordered)} paths, {at_root} of them at the crate root.\n"
    + "\n".join(ordered) + "\n"
)
write_or_check(
    "emm/public-api.txt", text,
    "emm's public API changed: if that is meant, run `python3 ci/public_api.py --write` and "
    "commit emm/public-api.txt (a reviewer sees what embedders gain or lose)",
)
