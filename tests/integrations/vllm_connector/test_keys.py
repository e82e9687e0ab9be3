"""A hit never crosses content, model or attention backend (through vLLM 0.33's scheduler).

vLLM keys a block by its token ids and extra keys (images, prompt embeddings,
LoRA, cache salt). Two requests with the same token ids but different images
must share no page past the image; two deployments that differ in revision,
quantization, rope settings, ``hf_overrides`` or attention backend must share
no page at all (their fingerprints differ).
"""
from __future__ import annotations

import pytest
import torch

from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.request import Request

from hicache.integrations.vllm_connector import layout_of
from tests.integrations.vllm_connector.harness import BLOCK, Engine, connector_config, kv_cache_config, make_request
from tests.integrations.vllm_connector.harness import TOY, tokens
from tests.integrations.vllm_connector.test_scheduler_path import extra, finish_idle


class _NoEncoder(Request):
    """The stand-in model has no vision encoder: vLLM schedules these requests as text, while
    their block hashes and ``mm_features`` (what the connector keys by) carry the images."""

    @property
    def has_encoder_inputs(self) -> bool:
        return False


def _with_images(rid: str, toks: list[int], images: list[tuple[str, int, int]]) -> Request:
    base = make_request(rid, toks)
    feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                   mm_position=PlaceholderRange(offset=off, length=n)) for ident, off, n in images]
    return _NoEncoder(request_id=rid, prompt_token_ids=list(toks), sampling_params=base.sampling_params,
                      pooling_params=None, mm_features=feats, block_hasher=base._block_hasher)


def _serve(eng: Engine, req: Request) -> tuple[str, int, int, bool]:
    eng.scheduler.add_request(req)
    eng.run()
    return eng.lookups[-1]


@pytest.mark.parametrize("offset,shared_pages", [(0, 0), (2 * BLOCK + 5, 2)])
def test_same_token_ids_with_another_image_share_no_page_past_it(tmp_path, offset, shared_pages):
    eng = Engine(extra(tmp_path))
    p = tokens(31, 6 * BLOCK + 3)  # the image's placeholder ids are the same in every request
    _serve(eng, _with_images("a", p, [("image-A", offset, 2 * BLOCK)]))
    assert eng.core.stats().saved_pages == 6
    eng.reset_vllm_prefix_cache()
    assert _serve(eng, _with_images("b", p, [("image-B", offset, 2 * BLOCK)]))[2] == shared_pages * BLOCK
    eng.reset_vllm_prefix_cache()
    assert _serve(eng, _with_images("c", p, [("image-A", offset, 2 * BLOCK)]))[2] == 6 * BLOCK  # the same image
    eng.reset_vllm_prefix_cache()
    assert _serve(eng, make_request("d", p))[2] == shared_pages * BLOCK  # text only: no image's pages
    finish_idle(eng)


def test_the_same_image_at_another_offset_is_another_page(tmp_path):
    eng = Engine(extra(tmp_path))
    p = tokens(32, 6 * BLOCK + 3)
    _serve(eng, _with_images("a", p, [("image-A", BLOCK, BLOCK)]))
    eng.reset_vllm_prefix_cache()
    assert _serve(eng, _with_images("b", p, [("image-A", BLOCK + 4, BLOCK)]))[2] == BLOCK
    finish_idle(eng)


def test_prompt_embeddings_key_their_pages(tmp_path):
    eng = Engine(extra(tmp_path))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4 * BLOCK + 3, 8, generator=g), torch.randn(4 * BLOCK + 3, 8, generator=g)
    b[:2 * BLOCK] = a[:2 * BLOCK]  # the first two pages' embeddings agree
    ids = tokens(33, 4 * BLOCK + 3)

    def req(rid, emb):
        base = make_request(rid, ids)
        return Request(request_id=rid, prompt_token_ids=ids, prompt_embeds=emb, sampling_params=base.sampling_params,
                       pooling_params=None, block_hasher=base._block_hasher)
    _serve(eng, req("a", a))
    eng.reset_vllm_prefix_cache()
    assert _serve(eng, req("b", b))[2] == 2 * BLOCK
    eng.reset_vllm_prefix_cache()
    assert _serve(eng, make_request("c", ids))[2] == 0  # the token ids alone are other content
    finish_idle(eng)


def _fingerprint(mutate) -> str:
    cfg = connector_config({"storage": {"url": ""}})
    mutate(cfg)
    return layout_of(cfg, kv_cache_config(TOY, 16)).fingerprint()


@pytest.mark.parametrize("what,mutate", [
    ("revision", lambda c: setattr(c.model_config, "revision", "v2")),
    ("quantization", lambda c: setattr(c.model_config, "quantization", "fp8")),
    ("hf_overrides", lambda c: setattr(c.model_config, "hf_overrides", {"rope_theta": 500000.0})),
    ("rope scaling", lambda c: setattr(c.model_config.hf_config, "rope_scaling", {"type": "yarn", "factor": 4.0})),
    ("attention backend", lambda c: setattr(c.attention_config, "backend", AttentionBackendEnum.FLASHINFER)),
])
def test_another_model_or_backend_has_another_fingerprint(what, mutate):
    assert _fingerprint(lambda c: None) == _fingerprint(lambda c: None)
    assert _fingerprint(mutate) != _fingerprint(lambda c: None), what


def test_another_revision_gets_no_hit(tmp_path):
    a = Engine(extra(tmp_path))
    p = tokens(34, 4 * BLOCK + 1)
    _serve(a, make_request("a", p))
    finish_idle(a)
    cfg = connector_config(extra(tmp_path))
    cfg.model_config.revision = "v2"
    b = Engine(None, vllm_config=cfg)
    assert _serve(b, make_request("b", p))[2] == 0
    c = Engine(extra(tmp_path))  # the first revision again: its pages are there
    assert _serve(c, make_request("c", p))[2] == 4 * BLOCK
    finish_idle(b)
    finish_idle(c)
