"""Runs the DuckDB queries of docs/analysis.md, as written there, on a folder of traces.

usage: doc_queries.py DOC DIR   (DIR holds traces/*.jsonl; the queries name that path)
Prints one JSON line per statement that returns rows: {"sql": last line, "rows": [...]}.
"""
import json
import os
import sys

import duckdb


def sql_block(doc: str) -> str:
    section = doc[doc.index("## A folder of traces"):]
    start = section.index("```sql") + len("```sql")
    return section[start:section.index("```", start)]


def statements(sql: str):
    for stmt in sql.split(";"):
        code = [l for l in stmt.splitlines() if l.strip() and not l.strip().startswith("--")]
        if code:
            yield "\n".join(code)


def main() -> None:
    doc, folder = sys.argv[1], sys.argv[2]
    sql = sql_block(open(doc, encoding="utf-8").read())
    os.chdir(folder)
    con = duckdb.connect()
    for stmt in statements(sql):
        rel = con.sql(stmt)
        if rel is None:
            continue
        rows = [[v if isinstance(v, (int, float, str)) or v is None else str(v) for v in r] for r in rel.fetchall()]
        print(json.dumps({"sql": stmt.splitlines()[-1].strip(), "rows": rows}))


if __name__ == "__main__":
    main()
