// The calculator of chapter 13 for the static book: the arithmetic of
// companion/analysis/calculator.py (count_params, kv_cache_bytes_per_token,
// kv_cache_bytes, flops_per_token) on the dials' values, in exact integers (BigInt),
// after the checks ModelConfig runs (companion/models/validation.py, config_parts.py,
// config_streams.py) on what the dials can reach: a config it rejects gets no numbers,
// only its error.
// tests/browser/test_html.py sets every preset, random dials and invalid ones, and
// requires these numbers (or errors) to equal companion's for the same configuration.
(function () {
  "use strict";
  const root = document.currentScript.closest(".calc");
  const spec = JSON.parse(root.querySelector("script.calc-data").textContent);
  const dial = (name) => root.querySelector("#calc-" + name);
  const NORMS_PER_LAYER = { pre: 2n, post: 2n, sandwich: 4n, post_branch: 2n };
  const min = (a, b) => (a < b ? a : b);
  const field = (name) => spec.fields[name] || name; // the config's name for a dial
  // Python's repr of a float (1 -> "1.0"; ordinary magnitudes only)
  const pyFloat = (x) => Math.abs(x) === Infinity ? (x > 0 ? "inf" : "-inf")
    : Number.isInteger(x) && Math.abs(x) < 1e16 ? x.toFixed(1) : String(x);
  const NUMBER = /^[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$/i;

  // dial values: BigInt for integers, Number for floats (null if unreadable), booleans, strings
  function read() {
    const c = {};
    for (const [name, kind] of Object.entries(spec.kinds)) {
      const el = dial(name), text = el.value.trim();
      if (kind === "bool") c[name] = el.checked;
      else if (kind === "int") c[name] = text === "" ? 0n : /^[-+]?\d+$/.test(text) ? BigInt(text) : null;
      else if (kind === "float") c[name] = text === "" ? 0 : NUMBER.test(text) ? Number(text) : null;
      else c[name] = el.value;
    }
    return c;
  }

  // a pattern dial repeated to the depth, as chapter 13's build() does; null if bad
  function pattern(c, name) {
    const letters = spec.patterns[name], text = c[name].trim().toUpperCase();
    if (!text || [...text].some((l) => !(l in letters))) return null;
    const n = Number(c.n_layers > 0n ? c.n_layers : 0n);
    return Array.from({ length: n }, (_, i) => letters[text[i % text.length]]);
  }

  // --- the config's rules: each group stops at its first error, as its check raises ---
  function problems(c) {
    const out = [];
    const first = (checks) => {
      for (const check of checks) {
        const message = check();
        if (message) return out.push(message) && false;
      }
      return true;
    };
    const quote = (s) => "'" + s + "'";
    const whole = (name, least) => () => {
      const v = c[name];
      const what = least === 0n ? "a non-negative integer" : "a positive integer";
      if (v === null) return `${field(name)} must be ${what}, got ${quote(dial(name).value)}`;
      return v < least ? `${field(name)} must be ${what}, got ${v}` : "";
    };
    const lettersOf = (name) => "[" + Object.keys(spec.patterns[name]).sort().map(quote).join(", ") + "]";
    for (const name of Object.keys(spec.patterns)) {
      if (name === "indexer_layers" && c.indexer_topk === 0n) continue; // dense: unread
      c[name + "_kinds"] = pattern(c, name);
      if (!c[name + "_kinds"]) out.push(`${field(name)} must be letters from ${lettersOf(name)}, got ${quote(c[name])}`);
    }
    const kinds = c.layer_types_kinds;
    if (!kinds) return out;
    const on = { moe: c.n_experts !== 0n, mla: c.kv_lora_rank !== 0n, sparse: c.indexer_topk !== 0n };
    on.compression = c.compression_q_lora_rank !== 0n;
    on.residual = c.residual_n_streams !== 0n;
    on.linear = kinds.includes("linear");
    const ints = (...names) => names.map((n) => whole(n, 1n));
    if (on.moe) {
      first([
        whole("n_experts", 1n), whole("experts_per_token", 1n), whole("dense_layers", 0n),
        whole("shared_d_ff", 0n), whole("hash_layers", 0n), whole("expert_d_ff", 1n),
        () => c.experts_per_token > c.n_experts
          ? `moe.experts_per_token must be in [1, n_experts=${c.n_experts}], got ${c.experts_per_token}` : "",
        () => c.shared_expert_gate && c.shared_d_ff === 0n
          ? "moe.shared_expert_gate needs a shared expert: set moe.shared_d_ff > 0" : "",
      ]);
    }
    if (on.mla) first([
      ...ints("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
      whole("q_lora_rank", 0n),
    ]);
    if (on.sparse) first(ints("indexer_n_heads", "indexer_head_dim", "indexer_topk"));
    if (on.linear) {
      const kh = c.linear_key_heads, vh = c.linear_value_heads, kda = c.linear_kind === "kda";
      first([
        ...ints("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv_kernel"),
        () => kda && vh !== kh ? `linear.kind='kda' needs linear.value_heads == linear.key_heads, got ${vh} and ${kh}` : "",
        () => kda && c.linear_value_dim !== c.linear_key_dim
          ? `linear.kind='kda' needs linear.value_dim == linear.key_dim, got ${c.linear_value_dim} and ${c.linear_key_dim}` : "",
        () => !kda && c.kda_layout !== "kimi"
          ? `linear.kda_layout has no effect unless linear.kind == 'kda' (got kind=${quote(c.linear_kind)})` : "",
        () => vh % kh !== 0n ? `linear.value_heads (${vh}) must be a multiple of linear.key_heads (${kh})` : "",
      ]);
    }
    if (on.compression) {
      const names = ["q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk"];
      first(ints(...names.concat("csa_ratio", "hca_ratio").map((n) => "compression_" + n)));
    }
    if (on.residual) first(ints("residual_n_streams"));
    if (!on.mla) {
      for (const [name, set] of [["q_lora_rank", c.q_lora_rank !== 0n], ["output_gate", c.mla_output_gate], ["indexer", on.sparse]]) {
        if (set) out.push(`mla.${name} needs multi-head latent attention: set mla.kv_lora_rank > 0`);
      }
    }
    for (const name of ["partial_rotary_factor", "swiglu_limit"]) { // the page's own: a number
      if (c[name] === null && (on.moe || name !== "swiglu_limit")) out.push(`${field(name)} must be a number, got ${quote(dial(name).value)}`);
    }
    const usage = [whole("context", 0n), ...ints("batch", "dtype_bytes", "state_dtype_bytes"), whole("scale_bytes", 0n)]
      .map((check) => check()).filter(Boolean);
    if (out.length) return out.concat(usage); // the model is checked once its groups are built
    const w = c.sliding_window, L = c.n_layers, idx = c.indexer_layers_kinds, pf = c.partial_rotary_factor;
    const rotated = (width) => Math.trunc(Number(width) * pf); // int(width * factor)
    const firstAttention = kinds.findIndex((k) => k !== "linear");
    first([
      ...ints("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "d_ff", "head_dim", "n_kv_heads"),
      () => c.n_heads % c.n_kv_heads !== 0n ? `n_heads (${c.n_heads}) must be a multiple of n_kv_heads (${c.n_kv_heads})` : "",
      () => w !== 0n ? whole("sliding_window", 1n)() : "",
      () => kinds.includes("sliding") && w === 0n ? "layer_types has 'sliding' layers but sliding_window is None" : "",
      () => on.mla && !["rope", "none"].includes(c.position)
        ? `multi-head latent attention needs position='rope' (or 'none': no RoPE, Kimi Linear), got ${quote(c.position)}` : "",
      () => {
        const qk = on.mla ? c.qk_nope_head_dim + c.qk_rope_head_dim : c.head_dim;
        if (c.head_dim === qk) return "";
        return `head_dim under multi-head latent attention is mla.qk_nope_head_dim + mla.qk_rope_head_dim = ${qk} (or None), got ${c.head_dim}; MLA sets its widths in mla`;
      },
      () => on.sparse && c.q_lora_rank === 0n ? "mla.indexer reads the query latent: set mla.q_lora_rank > 0" : "",
      () => on.sparse && c.indexer_head_dim < c.qk_rope_head_dim
        ? `mla.indexer.head_dim (${c.indexer_head_dim}) must be at least mla.qk_rope_head_dim (${c.qk_rope_head_dim}), the channels it rotates` : "",
      () => on.sparse && kinds.includes("sliding")
        ? "mla.indexer (sparse attention) does not combine with 'sliding' layers: the indexer's selection is the whole mask" : "",
      () => on.sparse && firstAttention >= 0 && idx[firstAttention] !== "full"
        ? `mla.indexer.layers: the first attention layer (${firstAttention}) must be 'full'; a 'shared' layer reuses the selection of a 'full' one before it` : "",
      ...streams(c, on, kinds, rotated(c.head_dim)),
      () => !(pf > 0 && pf !== Infinity) ? `partial_rotary_factor must be a finite number > 0, got ${pyFloat(pf)}`
        : pf > 1 ? `partial_rotary_factor must be in (0, 1], got ${pyFloat(pf)}` : "",
      () => w !== 0n && !kinds.includes("sliding") && !on.compression ? `sliding_window=${w} has no effect: layer_types has no 'sliding' layer` : "",
      () => on.moe && c.dense_layers >= L
        ? `moe.dense_layers=${c.dense_layers} leaves no MoE layer in n_layers=${L}: set moe.dense_layers < n_layers, or moe=None for a dense model` : "",
      () => {
        const width = on.mla ? c.qk_rope_head_dim : c.head_dim, name = on.mla ? "qk_rope_head_dim" : "head_dim";
        const r = rotated(width);
        if (c.position !== "rope" || (r >= 2 && r % 2 === 0)) return "";
        return `rope settings: rotary width head_dim * partial_rotary_factor must be even and >= 2, got ${r}, from ${name}=${width} and partial_rotary_factor=${pyFloat(pf)}`;
      },
    ]);
    return out.concat(usage);
  }

  // DeepSeek-V4's rules (config_streams.validate_streams), in its order
  function streams(c, on, kinds, rotated) {
    const quote = (s) => "'" + s + "'", list = (xs) => "[" + xs.map(quote).join(", ") + "]";
    const compressed = ["csa", "hca"].filter((k) => kinds.includes(k));
    const other = [...new Set(kinds)].filter((k) => !["sliding", "csa", "hca"].includes(k)).sort();
    const py = (b) => (b ? "True" : "False");
    const attention = [ // name, value (repr), what compression needs
      ["mla", on.mla ? mlaRepr(c) : "None", "None"], ["qk_norm", quote(c.qk_norm), "'none'"],
      ["attn_output_gate", py(c.attn_output_gate), "False"], ["attn_sinks", py(c.attn_sinks), "True"],
      ["n_kv_heads", String(c.n_kv_heads), "1"],
    ];
    const compression = [
      () => other.length ? "compression makes every layer compressed attention: layer_types entries must be "
        + `'sliding', 'csa' or 'hca', got ${list(other)}` : "",
      () => c.sliding_window === 0n ? "compression needs sliding_window: every layer has the window" : "",
      () => c.position !== "rope" ? `compression needs position='rope', got ${quote(c.position)}` : "",
      () => {
        const [name, value, want] = attention.find(([, value, want]) => value !== want) || [];
        return name ? `${name}=${value} does not combine with compression (DeepSeek-V4's attention): it needs ${name}=${want}` : "";
      },
      () => c.n_heads % c.compression_o_groups !== 0n
        ? `compression.o_groups (${c.compression_o_groups}) must divide n_heads (${c.n_heads})` : "",
      () => Number(c.compression_index_head_dim) < rotated
        ? `compression.index_head_dim (${c.compression_index_head_dim}) must be at least the rotated channels (${rotated})` : "",
    ];
    const hashed = c.hash_layers > 0n, limit = c.swiglu_limit;
    const moe = [
      () => limit < 0 || limit === Infinity ? `moe.swiglu_limit must be None or a finite number > 0, got ${pyFloat(limit)}` : "",
      () => hashed && c.router_bias
        ? "moe.hash_layers take their experts from a table: they need moe.router_groups=1 and moe.router_bias=False" : "",
      () => limit !== 0 && c.expert_kind !== "glu"
        ? `moe.swiglu_limit clamps 'glu' experts (gpt_oss's clamp is fixed), got moe.expert_kind=${quote(c.expert_kind)}` : "",
      () => hashed && c.dense_layers + c.hash_layers > c.n_layers
        ? `moe.hash_layers=${c.hash_layers} after moe.dense_layers=${c.dense_layers} exceed n_layers=${c.n_layers}` : "",
    ];
    return [
      () => !on.compression && compressed.length
        ? `layer_types has ${list(compressed)} layers: set compression=CompressedAttentionConfig(...)` : "",
      ...(on.compression ? compression : []),
      () => on.residual && c.norm_placement !== "pre" ? "residual (hyper-connections) replaces the residual add: it "
        + `needs norm_placement='pre' and dropout=0, got ${quote(c.norm_placement)} and 0.0` : "",
      ...(on.moe ? moe : []),
    ];
  }

  // repr(cfg.mla) as the dials give it: the fields that differ from their defaults
  function mlaRepr(c) {
    const names = ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"];
    const parts = names.map((n) => `${n}=${c[n]}`);
    if (c.q_lora_rank !== 0n) parts.push(`q_lora_rank=${c.q_lora_rank}`);
    if (c.mla_output_gate) parts.push("output_gate=True");
    if (c.indexer_topk !== 0n) {
      const idx = [`n_heads=${c.indexer_n_heads}`, `head_dim=${c.indexer_head_dim}`, `topk=${c.indexer_topk}`];
      const layers = c.indexer_layers_kinds;
      const tuple = "(" + layers.map((k) => "'" + k + "'").join(", ") + (layers.length === 1 ? ",)" : ")");
      if (layers.includes("shared")) idx.push(`layers=${tuple}`);
      parts.push(`indexer=SparseConfig(${idx.join(", ")})`);
    }
    return `MLAConfig(${parts.join(", ")})`;
  }

  // --- the arithmetic of companion.analysis.calculator and mixer_params ---
  function attention(c) {
    const d = c.d_model, h = c.n_heads, D = c.head_dim;
    const qOut = h * D * (c.attn_output_gate ? 2n : 1n);
    const kvOut = c.n_kv_heads * D;
    const matrices = d * (qOut + 2n * kvOut) + h * D * d;
    let extra = (c.qkv_bias ? qOut + 2n * kvOut : 0n) + (c.bias ? d : 0n);
    if (c.qk_norm === "head") extra += 2n * D;
    else if (c.qk_norm === "full") extra += h * D + kvOut;
    if (c.attn_sinks) extra += h;
    return [matrices + extra, matrices];
  }

  function latent(c, own) {
    const d = c.d_model, h = c.n_heads, r = c.kv_lora_rank, rq = c.q_lora_rank;
    const qHeads = h * c.head_dim;
    const q = rq === 0n ? d * qHeads : d * rq + rq * qHeads;
    const kvA = d * (r + c.qk_rope_head_dim);
    const kvB = r * h * (c.qk_nope_head_dim + c.v_head_dim);
    let matrices = q + kvA + kvB + h * c.v_head_dim * d, params = matrices + rq + r;
    if (c.mla_output_gate) [params, matrices] = [params + h * d, matrices + h * d];
    if (own) { // the lightning indexer: queries from the latent, one key, head weights
      const hi = c.indexer_n_heads, di = c.indexer_head_dim;
      const m = rq * hi * di + d * (di + hi);
      [params, matrices] = [params + m + 2n * di, matrices + m];
    }
    return [params, matrices];
  }

  function deltanet(c) {
    const d = c.d_model, hv = c.linear_value_heads;
    const keys = c.linear_key_heads * c.linear_key_dim, values = hv * c.linear_value_dim;
    const weights = d * (2n * keys + 2n * values) + d * 2n * hv
      + (2n * keys + values) * c.linear_conv_kernel + values * d;
    return [weights + 2n * hv + c.linear_value_dim, weights];
  }

  function kimiDelta(c) {
    const d = c.d_model, h = c.linear_key_heads, dh = c.linear_key_dim, width = h * dh;
    const gates = c.kda_layout === "kimi" ? 2n * (d * dh + dh * width) : 2n * d * width;
    const weights = 3n * d * width + 3n * width * c.linear_conv_kernel + d * h + gates + width * d;
    return [weights + width + h + dh, weights];
  }

  // DeepSeek-V4: the pooling ratio m of a layer kind (0: sliding, the window only)
  const ratio = (c, kind) => (kind === "csa" ? c.compression_csa_ratio : kind === "hca" ? c.compression_hca_ratio : 0n);

  // one compressed-attention layer: latent queries, one KV head, grouped output, sinks;
  // CSA/HCA add a compressor, CSA its indexer (mixer_params.compressed_attention_params)
  function compressedAttention(c, kind) {
    const d = c.d_model, h = c.n_heads, D = c.head_dim, cq = c.compression_q_lora_rank;
    const ro = c.compression_o_lora_rank, out = c.compression_o_groups * ro;
    let matrices = d * cq + cq * h * D + d * D + h * D * ro + out * d;
    let params = matrices + cq + D + h;
    if (kind === "sliding") return [params, matrices];
    const m = ratio(c, kind), width = (kind === "csa" ? 2n : 1n) * D;
    matrices += 2n * d * width;
    params += 2n * d * width + m * width + D;
    if (kind === "csa") {
      const hi = c.compression_index_n_heads, di = c.compression_index_head_dim;
      const index = 2n * d * 2n * di + cq * hi * di + d * hi;
      matrices += index;
      params += index + m * 2n * di + di;
    }
    return [params, matrices];
  }

  // numbers a compressed layer caches for `tokens` positions (compressed_cache_bytes)
  function compressedCache(c, kind, tokens) {
    const D = c.head_dim, m = ratio(c, kind);
    let numbers = min(tokens, c.sliding_window) * D;
    if (kind !== "sliding") {
      const overlap = kind === "csa" ? 2n : 1n;
      numbers += (tokens / m) * D + 2n * (overlap * m) * (overlap * D);
    }
    if (kind === "csa") {
      const di = c.compression_index_head_dim;
      numbers += (tokens / m) * di + 2n * (2n * m) * (2n * di);
    }
    return numbers;
  }

  // rows a compressed layer holds, each with a scale (cache_size._compressed_rows)
  function compressedRows(c, kind, tokens) {
    const m = ratio(c, kind);
    let rows = min(tokens, c.sliding_window);
    if (kind !== "sliding") rows += tokens / m + 2n * (kind === "csa" ? 2n : 1n) * m;
    if (kind === "csa") rows += tokens / m + 4n * m;
    return rows;
  }

  // bytes per token: the window's key per layer + pooled entries amortised, their
  // numbers and their rows' scales, rounded up once
  function compressedPerToken(c) {
    const D = c.head_dim, mc = c.compression_csa_ratio, mh = c.compression_hca_ratio;
    const count = (k) => BigInt(c.kinds.filter((x) => x === k).length);
    const num = c.n_layers * D * mc * mh + count("csa") * (D + c.compression_index_head_dim) * mh + count("hca") * D * mc;
    const rows = c.n_layers * mc * mh + count("csa") * 2n * mh + count("hca") * mc;
    const den = mc * mh;
    return (num * c.dtype_bytes + rows * c.scale_bytes + den - 1n) / den;
  }

  // one hyper-connection (parameters, matrix weights) and the head over n streams
  function hyper(c) {
    const n = c.residual_n_streams, fn = (2n + n) * n * n * c.d_model;
    return [fn + (2n + n) * n + 3n, fn, n * n * c.d_model + n + 1n];
  }

  function denseFfn(c) {
    const d = c.d_model, f = c.d_ff, glu = c.ffn === "glu";
    const matrices = (glu ? 3n : 2n) * d * f;
    return [matrices + (c.bias ? (glu ? 2n * f : f) + d : 0n), matrices];
  }

  // does layer i run (and cache) an indexer of its own?
  const ownIndexer = (c, i) =>
    c.kv_lora_rank > 0n && c.indexer_topk > 0n && c.kinds[i] !== "linear" && c.indexer_layers_kinds[i] === "full";

  function tally(c) {
    const t = { total: 0n, active: 0n, macs: 0n };
    const add = (total, active, macs) => {
      t.total += total;
      t.active += active === null ? total : active;
      t.macs += macs;
    };
    const d = c.d_model, v = c.vocab_size;
    add(v * d, null, 0n);
    if (c.position === "learned") add(c.max_seq_len * d, null, 0n);
    const norm = d * (c.norm === "layernorm" && c.bias ? 2n : 1n);
    c.kinds.forEach((kind, layer) => {
      const [p, w] = kind === "linear" ? (c.linear_kind === "kda" ? kimiDelta(c) : deltanet(c))
        : c.compression_q_lora_rank > 0n ? compressedAttention(c, kind)
          : c.kv_lora_rank > 0n ? latent(c, ownIndexer(c, layer)) : attention(c);
      add(p, null, w);
      if (c.residual_n_streams > 0n) { // a hyper-connection around each of the two sublayers
        const [hc, hw] = hyper(c);
        add(2n * hc, null, 2n * hw);
      }
      if (c.n_experts > 0n && BigInt(layer) >= c.dense_layers) {
        const e = c.n_experts, k = c.experts_per_token, fe = c.expert_d_ff;
        const hashed = BigInt(layer) < c.dense_layers + c.hash_layers; // no selection bias; a table of k ids per token
        add(e * d + (c.router_bias ? e : 0n) + (c.router_selection_bias && !hashed ? e : 0n), null, e * d);
        if (hashed) add(v * k, null, 0n);
        const one = 3n * d * fe + (c.expert_kind === "gpt_oss" ? 2n * fe + d : 0n);
        add(e * one, k * one, k * 3n * d * fe);
        if (c.shared_d_ff > 0n) {
          const shared = 3n * d * c.shared_d_ff + (c.shared_expert_gate ? d : 0n);
          add(shared, null, shared);
        }
      } else {
        const [fp, fw] = denseFfn(c);
        add(fp, null, fw);
      }
      add(NORMS_PER_LAYER[c.norm_placement] * norm, null, 0n);
    });
    if (c.norm_placement !== "post") add(norm, null, 0n);
    if (c.residual_n_streams > 0n) { // the head that collapses the streams
      const head = hyper(c)[2];
      add(head, null, head - c.residual_n_streams - 1n);
    }
    add(c.tie_embeddings ? 0n : v * d, null, v * d);
    return t;
  }

  // numbers one attention layer caches per position (+ its indexer's key)
  const cacheWidth = (c, i) =>
    (c.kv_lora_rank > 0n ? c.kv_lora_rank + c.qk_rope_head_dim : 2n * c.n_kv_heads * c.head_dim)
    + (ownIndexer(c, i) ? c.indexer_head_dim : 0n);
  // and the rows they make, one scale each: K and V per head, or one latent row
  const cacheRows = (c, i) =>
    (c.kv_lora_rank > 0n ? 1n : 2n * c.n_kv_heads) + (ownIndexer(c, i) ? 1n : 0n);
  const rowBytes = (c, i) => cacheWidth(c, i) * c.dtype_bytes + cacheRows(c, i) * c.scale_bytes;

  function kvBytes(c, tokens) {
    let total = 0n;
    c.kinds.forEach((kind, i) => {
      if (kind === "linear") {
        const hk = c.linear_key_heads, hv = c.linear_value_heads;
        const dk = c.linear_key_dim, dv = c.linear_value_dim;
        total += hv * dk * dv * c.state_dtype_bytes;
        const conv = (2n * hk * dk + hv * dv) * c.dtype_bytes + (2n * hk + hv) * c.scale_bytes;
        total += conv * (c.linear_conv_kernel - 1n); // one row per head and position
      } else if (c.compression_q_lora_rank > 0n) {
        total += compressedCache(c, kind, tokens) * c.dtype_bytes + compressedRows(c, kind, tokens) * c.scale_bytes;
      } else {
        const kept = kind === "sliding" ? min(tokens, c.sliding_window) : tokens;
        total += kept * rowBytes(c, i);
      }
    });
    return c.batch * total;
  }

  function flops(c, macs) {
    let mixing = 0n;
    c.kinds.forEach((kind, i) => {
      if (kind === "linear") {
        mixing += 6n * c.linear_value_heads * c.linear_key_dim * c.linear_value_dim;
        return;
      }
      if (c.compression_q_lora_rank > 0n) { // the window's keys and the entries read
        const m = ratio(c, kind);
        let entries = kind === "sliding" ? 0n : c.context / m;
        if (kind === "csa") { // the indexer scores every entry, attention reads the best
          mixing += 2n * entries * c.compression_index_n_heads * c.compression_index_head_dim;
          entries = min(entries, c.compression_index_topk);
        }
        mixing += 4n * (min(c.context, c.sliding_window) + entries) * c.n_heads * c.head_dim;
        return;
      }
      let s = kind === "sliding" ? min(c.context, c.sliding_window) : c.context;
      if (c.kv_lora_rank > 0n && c.indexer_topk > 0n) { // DSA: k keys, picked by the indexer
        if (ownIndexer(c, i)) mixing += 2n * s * c.indexer_n_heads * c.indexer_head_dim;
        s = min(s, c.indexer_topk);
      }
      const dv = c.kv_lora_rank > 0n ? c.v_head_dim : c.head_dim;
      mixing += 2n * s * c.n_heads * (c.head_dim + dv);
    });
    return 2n * macs + mixing;
  }

  // 8030261248 -> "8.03 B"; bytes in KiB, MiB, GiB
  function human(n, unit) {
    const x = Number(n);
    if (unit === "bytes") {
      const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
      let i = 0, y = x;
      while (y >= 1024 && i < units.length - 1) { y /= 1024; i++; }
      return (i ? y.toFixed(2) : String(y)) + " " + units[i];
    }
    const steps = [[1e12, " T"], [1e9, " B"], [1e6, " M"], [1e3, " k"]];
    for (const [size, name] of steps) if (x >= size) return (x / size).toFixed(2) + name;
    return String(x);
  }

  function show(id, value, unit) {
    const el = root.querySelector("#calc-" + id);
    if (value === null) { // no model: no number
      delete el.dataset.value;
      el.textContent = el.title = "";
      return;
    }
    el.dataset.value = value.toString();
    el.textContent = human(value, unit);
    el.title = value.toLocaleString("en-US");
  }

  function update() {
    const c = read();
    const found = problems(c);
    root.querySelector(".calc-problems").textContent = found.join("; ");
    if (found.length) {
      for (const id of ["total", "active", "kv-per-token", "kv-total", "flops-per-token"]) show(id, null);
      return;
    }
    c.kinds = c.layer_types_kinds;
    const t = tally(c);
    show("total", t.total, "count");
    show("active", t.active, "count");
    let perToken = 0n;
    c.kinds.forEach((kind, i) => { if (kind !== "linear") perToken += rowBytes(c, i); });
    if (c.compression_q_lora_rank > 0n) perToken = compressedPerToken(c);
    show("kv-per-token", perToken, "bytes");
    show("kv-total", kvBytes(c, c.context), "bytes");
    show("flops-per-token", flops(c, t.macs), "count");
  }

  function load(name) {
    for (const [field, value] of Object.entries(spec.presets[name])) {
      const el = dial(field);
      if (spec.kinds[field] === "bool") el.checked = value;
      else el.value = String(value);
    }
    update();
  }

  dial("preset").addEventListener("change", (e) => load(e.target.value));
  root.querySelectorAll("input, select").forEach((el) => {
    if (el.id === "calc-preset") return;
    el.addEventListener("input", update);
    el.addEventListener("change", update);
  });
  load(dial("preset").value);
})();
