"""Deliberately broken QKV transforms: weight-map bugs that parity checks must catch."""

from __future__ import annotations

import torch

from mcore_zoo.weights.rules import FuseQKV


class SwapFirstTwoQueryHeads(FuseQKV):
    name = "qkv-interleave-with-swapped-heads"

    def fuse(self, pieces, ctx):
        q, k, v = pieces
        hd = ctx.arch.head_dim
        q = torch.cat([q[hd : 2 * hd], q[:hd], q[2 * hd :]])
        return super().fuse([q, k, v], ctx)


class SwapQueryAndKey(FuseQKV):
    """Each group's key head in place of its first query head, and vice versa."""

    name = "qkv-interleave-with-q-k-swapped"

    def fuse(self, pieces, ctx):
        q, k, v = pieces
        hd = ctx.arch.head_dim
        groups = k.shape[0] // hd
        qg = q.reshape(groups, -1, *q.shape[1:]).clone()
        kg = k.reshape(groups, hd, *k.shape[1:]).clone()
        first = qg[:, :hd].clone()
        qg[:, :hd] = kg
        return super().fuse([qg.reshape(q.shape), first.reshape(k.shape), v], ctx)
