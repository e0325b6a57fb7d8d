"""One-off GPU probe (not part of the package): what the graph-static design costs on an H100."""
import json, os, sys, time, statistics
import torch, torch.nn.functional as F
sys.path.insert(0, os.getcwd())
from fastdraft.models import CausalLM, ModelConfig, AttnMeta, KVView
from fastdraft.models.packing import pack_for_inference
from fastdraft.models import layers as L
from fastdraft.models.rope import RotaryEmbedding, RopeTable
def _rope_fwd(self, positions, dtype):
    return RopeTable(self.cos[positions].unsqueeze(2).to(dtype), self.sin[positions].unsqueeze(2).to(dtype))
RotaryEmbedding.forward = _rope_fwd

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = DEV == "cpu"
res = {}
def save():
    json.dump(res, open(f"{OUT}/probe.json", "w"), indent=1)

def timed_graph(fn, iters=50):
    if SMALL: return timed_eager(fn, 2)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    for _ in range(5): g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

def sync():
    if not SMALL: torch.cuda.synchronize()
def timed_eager(fn, iters=30):
    for _ in range(3): fn()
    sync(); t = time.perf_counter()
    for _ in range(iters): fn()
    sync(); return (time.perf_counter() - t) / iters * 1e3

# bandwidth
x = torch.empty(2 * 1024**(2 if SMALL else 3), dtype=torch.uint8, device=DEV); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
sync(); t = time.perf_counter()
for _ in range(20): y.copy_(x)
sync(); dt = (time.perf_counter() - t) / 20
res["bw_copy_GBps"] = 2 * x.numel() / dt / 1e9; del x, y; save(); print(res, flush=True)

hf = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
          num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
          max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
if SMALL: hf.update(vocab_size=40000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
cfg = ModelConfig.from_hf_dict(hf)
torch.manual_seed(0)
with torch.device(DEV):
    model = CausalLM(cfg, max_positions=8192).to(torch.bfloat16)
for p in model.parameters():
    if p.dim() > 1: p.data.normal_(0, 0.02)
pack_for_inference(model); model.eval()
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
res["weight_bytes"] = nbytes
def kv_bytes(B, C): return cfg.num_hidden_layers * 2 * B * cfg.num_key_value_heads * C * cfg.head_dim * 2

orig_attn = L.Attention.forward
def folded_forward(self, x, rope, kv, attn):
    bsz, T, _ = x.shape
    q, k, v = self._qkv(x, rope)
    keys, values = L._write_and_read(kv, self.layer_idx, k, v, attn)   # [B, Hkv, C, D]
    g = self.num_heads // self.num_kv_heads
    qf = q.view(bsz, T, self.num_kv_heads, g, self.head_dim).permute(0, 2, 3, 1, 4).reshape(
        bsz, self.num_kv_heads, g * T, self.head_dim)
    mask = attn.mask.unsqueeze(1).expand(bsz, g, T, -1).reshape(bsz, 1, g * T, -1)
    out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
    out = out.view(bsz, self.num_kv_heads, g, T, self.head_dim).permute(0, 3, 1, 2, 4)
    return self.o_proj(out.reshape(bsz, T, -1))

def run_case(B, C, T, variant):
    ncache = C + 32
    kc = torch.zeros(cfg.num_hidden_layers, 2, B, cfg.num_key_value_heads, ncache, cfg.head_dim,
                     dtype=torch.bfloat16, device=DEV)
    kv = KVView(list(kc[:, 0].unbind(0)), list(kc[:, 1].unbind(0)), torch.arange(B, device=DEV), 0)
    ids = torch.randint(0, 1000, (B, T), device=DEV)
    pos = (torch.full((B, 1), C - T - 1, device=DEV) + torch.arange(T, device=DEV))
    cols = torch.arange(C, device=DEV)
    mask = cols.view(1, 1, -1) <= pos.unsqueeze(-1)
    sees_all = variant == "nomask"
    meta = AttnMeta(mask, cache_positions=pos, sees_all=sees_all and T == 1)
    L.Attention.forward = folded_forward if variant == "folded" else orig_attn
    li = torch.full((B, T), 0, device=DEV)
    def fn():
        with torch.inference_mode():
            return model(ids, pos, kv, meta)
    try:
        ms = timed_graph(fn)
    except Exception as e:
        ms = f"ERR {type(e).__name__}: {e}"[:300]
    L.Attention.forward = orig_attn
    del kc
    if not SMALL: torch.cuda.empty_cache()
    return ms

with torch.inference_mode():
    for (B, C) in [(1, 512), (1, 4096), (8, 512), (64, 512), (64, 4096)]:
        for variant in ["nomask", "mask", "folded"]:
            ms = run_case(B, C, 1, variant)
            roof = (nbytes + kv_bytes(B, C)) / (res["bw_copy_GBps"] * 1e9) * 1e3
            res[f"decode_B{B}_C{C}_{variant}_ms"] = ms
            res[f"decode_B{B}_C{C}_roofline_ms"] = roof
            print(B, C, variant, ms, roof, flush=True); save()
    for variant in ["mask", "folded"]:
        res[f"verify17_B1_C512_{variant}_ms"] = run_case(1, 512, 17, variant); save()
    res["verify17_B8_C512_folded_ms"] = run_case(8, 512, 17, "folded"); save()
    print(res, flush=True)

# drafter level: one layer + lm_head on 4 rows (batch 1), full vocab vs 32k rows
from fastdraft.models.layers import DecoderLayer
with torch.device(DEV):
    layer = DecoderLayer(cfg, 0, input_norm=False).to(torch.bfloat16)
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False).to(torch.bfloat16)
pack_for_inference(layer)
head = model.lm_head.weight
sub = head[:32768].clone()
for nrows in (4, 8):
    for name, w in (("full", head), ("32k", sub)):
        dkc = torch.zeros(1, 2, 1, cfg.num_key_value_heads, 1024, cfg.head_dim, dtype=torch.bfloat16, device=DEV)
        kv = KVView([dkc[0, 0]], [dkc[0, 1]], torch.arange(1, device=DEV), 0)
        feats = torch.randn(1, nrows, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
        ids = torch.randint(0, 1000, (1, nrows), device=DEV)
        pos = torch.arange(500, 500 + nrows, device=DEV).view(1, -1)
        mask = torch.ones(1, nrows, 520, dtype=torch.bool, device=DEV)
        meta = AttnMeta(mask, cache_positions=pos)
        def fn():
            with torch.inference_mode():
                x = fc(torch.cat([F.embedding(ids, model.model.embed_tokens.weight), feats], -1))
                out = layer(x, model.rope(pos, x.dtype), kv, meta)
                logits = F.linear(out, w)
                return logits.float().log_softmax(-1).topk(4, -1)
        res[f"draft_level_rows{nrows}_{name}_ms"] = timed_graph(fn)
        save()
print(res, flush=True)

# eager decode B1 for reference (launch-bound)
kc = torch.zeros(cfg.num_hidden_layers, 2, 1, cfg.num_key_value_heads, 544, cfg.head_dim, dtype=torch.bfloat16, device=DEV)
kv = KVView(list(kc[:, 0].unbind(0)), list(kc[:, 1].unbind(0)), torch.arange(1, device=DEV), 0)
ids = torch.randint(0, 1000, (1, 1), device=DEV); pos = torch.full((1, 1), 500, device=DEV)
meta = AttnMeta(torch.arange(512, device=DEV).view(1, 1, -1) <= pos.unsqueeze(-1), cache_positions=pos)
def fn():
    with torch.inference_mode():
        return model(ids, pos, kv, meta)
res["decode_B1_C512_eager_ms"] = timed_eager(fn); save()
# profile of one graphed decode (kernel names and times)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU if SMALL else ProfilerActivity.CUDA]) as prof:
    for _ in range(3): fn()
    sync()
tab = prof.key_averages().table(sort_by="cpu_time_total" if SMALL else "cuda_time_total", row_limit=25)
open(f"{OUT}/profile.txt", "w").write(tab)
print(tab[:6000])
# torch.compile of the decode forward (static shapes)
if os.environ.get("PROBE_COMPILE", "0" if SMALL else "1") == "1":
    t0 = time.time()
    cm = torch.compile(model, dynamic=False)
    def fc2():
        with torch.inference_mode():
            return cm(ids, pos, kv, meta)
    try:
        fc2(); res["compile_s"] = time.time() - t0
        res["decode_B1_C512_compiled_graph_ms"] = timed_graph(fc2)
    except Exception as e:
        res["compile_err"] = str(e)[:500]
    save()
print(json.dumps(res, indent=1))
