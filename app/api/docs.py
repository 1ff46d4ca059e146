"""The JSON API's docs page at ``/api/v1/docs``: rendered from its OpenAPI schema, self-contained (no script,
nothing fetched from elsewhere), so it works on an offline machine."""

from __future__ import annotations

import html
from typing import Any

from app.guard.access import API_PREFIX

__all__ = ["docs_html"]


def docs_html(schema: dict[str, Any]) -> str:
    """A self-contained docs page for the schema (no script, nothing fetched from elsewhere)."""
    title, about = html.escape(schema["info"]["title"]), html.escape(schema["info"].get("description", ""))
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
           "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}"
           "code,pre{background:#f4f4f4}h3{margin-bottom:.2em}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}</style></head><body>",
           f"<h1>{title}</h1><p>{about}</p>",
           f"<p>The machine-readable schema: <a href='{API_PREFIX}/openapi.json'><code>{API_PREFIX}/openapi.json"
           "</code></a>. Errors are JSON <code>{\"detail\": \"...\"}</code>.</p>"]
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            out.append(f"<h3><code>{method.upper()} {html.escape(path)}</code> — {html.escape(op.get('summary', ''))}"
                       f"</h3><p>{html.escape(op.get('description', ''))}</p>")
            rows = [(p["name"], p["in"], _type(p.get("schema", {})), p.get("required", False),
                     p.get("description", "")) for p in op.get("parameters", [])]
            for kind, body in op.get("requestBody", {}).get("content", {}).items():
                ref = body.get("schema", {}).get("$ref", "")
                model = schema.get("components", {}).get("schemas", {}).get(ref.rsplit("/", 1)[-1], {})
                need = model.get("required", [])
                rows += [(name, kind, _type(prop), name in need, prop.get("description", ""))
                         for name, prop in model.get("properties", {}).items()]
            if rows:
                out.append("<table><tr><th>field</th><th>in</th><th>type</th><th>required</th><th></th></tr>")
                out += [f"<tr><td><code>{html.escape(n)}</code></td><td>{html.escape(w)}</td><td>{html.escape(t)}</td>"
                        f"<td>{'yes' if r else ''}</td><td>{html.escape(str(d))}</td></tr>" for n, w, t, r, d in rows]
                out.append("</table>")
            codes = ", ".join(f"{c} {html.escape(v.get('description', ''))}"
                              for c, v in op.get("responses", {}).items())
            out.append(f"<p><small>Responses: {codes}</small></p>")
    return "".join(out) + "</body></html>"


def _type(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"])
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if prop.get("format") == "binary" or prop.get("contentMediaType"):
        return "file"
    return str(prop.get("type", "any"))
