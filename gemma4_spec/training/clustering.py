"""Balanced k-means: the vocabulary split into equal-size clusters for the centroid head.

A Gemma 4 assistant with ``use_ordered_embeddings`` scores ``num_centroids`` centroids, keeps the
top k and takes the argmax over only those clusters' tokens. Its ``token_ordering`` lists the
tokens cluster by cluster (``vocab / num_centroids`` each). Clustering the rows of the trained
lm_head puts tokens the assistant confuses, the ones that compete for the same hidden states,
into the same cluster.
"""

from __future__ import annotations

import torch


def balanced_assign(scores: torch.Tensor, size: int) -> torch.Tensor:
    """Cluster of each row, at most ``size`` rows per cluster: greedy over the best scores."""
    rows, clusters = scores.shape
    assignment = torch.full((rows,), -1, dtype=torch.long)
    counts = [0] * clusters
    left = rows
    for flat in torch.argsort(scores.flatten(), descending=True, stable=True).tolist():
        row, cluster = divmod(flat, clusters)
        if assignment[row] >= 0 or counts[cluster] == size:
            continue
        assignment[row] = cluster
        counts[cluster] += 1
        left -= 1
        if left == 0:
            break
    return assignment


def balanced_kmeans(
    vectors: torch.Tensor, num_clusters: int, *, iterations: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spherical k-means with equal-size clusters.

    Returns ``(token_ordering, assignment)``: the row indices grouped cluster by cluster (ascending
    within a cluster), and the cluster of every row."""
    count = vectors.shape[0]
    if count % num_clusters:
        raise ValueError(f"{count} rows do not split into {num_clusters} equal clusters")
    size = count // num_clusters
    unit = torch.nn.functional.normalize(vectors.float(), dim=-1)
    centres = unit[torch.randperm(count, generator=generator)[:num_clusters]]
    assignment = balanced_assign(unit @ centres.T, size)
    for _ in range(iterations):
        sums = torch.zeros_like(centres).index_add_(0, assignment, unit)
        centres = torch.nn.functional.normalize(sums, dim=-1)
        assignment = balanced_assign(unit @ centres.T, size)
    ordering = torch.argsort(assignment * count + torch.arange(count), stable=True)
    return ordering, assignment
