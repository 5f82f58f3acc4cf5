"""Image inputs (issue 48): ``image_url`` content parts, their references, and reading their bytes.

One home for what both sides need to agree on: which parts of a chat message are images
(:mod:`~lmdq.images.parts`), what a reference may be and how submit checks one without loading its
pixels into Redis (:mod:`~lmdq.images.refs`: a ``data:`` URL kept inline up to ``LMDQ_MAX_IMAGE_BYTES``,
a local or mounted path, ``s3://``, ``http(s)://``), and how a worker reads the bytes behind one
(:mod:`~lmdq.images.fetch`). Jobs carry references; workers read the bytes.
"""
