"""lmdq from Python: a DataFrame in, each answer as it finishes, a Parquet file out.

Run a worker first (the embedded CPU model needs no GPU and no download):

    lmdq-worker &                       # serves smollm2-135m-instruct
    python examples/client_dataframe.py answers.parquet

Needs ``pip install 'lmdq[data]' pandas``. LMDQ_REDIS_URL picks the Redis (default localhost).
"""

from __future__ import annotations

import sys

import pandas as pd

import lmdq

questions = pd.DataFrame({
    "qid": ["fr", "jp", "it", "de"],
    "country": ["France", "Japan", "Italy", "Germany"],
    "max_new_tokens": [24, 24, 16, 16],
})


def main(out: str) -> None:
    client = lmdq.Client()
    try:
        batch = client.submit(
            questions, model="smollm2-135m-instruct",
            template="What is the capital of {country}? Answer in one word.",  # str.format over the columns
            id_column="qid", params_columns=["max_new_tokens"],  # a per-row generation parameter
            metadata={"example": "client_dataframe"},
        )
    except lmdq.SubmitRejected as e:  # a bad row: named by row and column, nothing enqueued
        sys.exit(f"error: {e}")
    print(f"submitted {batch.id} ({batch.counts().total} requests)")
    for r in batch.as_completed(timeout=600):
        print(f"{r.custom_id:>3}  {r.status.value:<9} {r.text.strip()!r}")
    rows = batch.to_parquet(out)
    print(f"wrote {rows} results to {out}")
    df = batch.to_pandas()  # the same schema: custom_id, row, status, text, token counts, timings ...
    print(df[["custom_id", "status", "generate_token_len"]].to_string(index=False))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "answers.parquet")
