"""A small random-weight Llama model for the KV-reuse demo, with direct access to its KV cache.

Request A prefills a prompt and saves its KV cache as blocks of N tokens; request B, in another
process, shares a long prefix, puts those blocks' K/V straight into the model's cache and prefills
only the rest. This module is the model half: it works on plain torch tensors and knows nothing of
gdkv's storage.

    >>> path = build_model("/tmp/gdkv-model")            # random weights from seed 0, saved once
    >>> model = load_model(path)
    >>> logits, cache = prefill(model, prompt_a)           # prompt_a: list[int] of 3072 ids
    >>> kv = [(k[:, :, :2560].contiguous(), v[:, :, :2560].contiguous())
    ...       for k, v in layer_kv(cache)]
    >>> logits, cache = prefill(model, prompt_b[2560:], past=kv)
    >>> tokens, step_logits = greedy(model, cache, logits, 16)

The default model (10 layers, hidden 768, 12 query heads sharing 4 KV heads, head_dim 64, MLP 2048,
vocab 8192; 75.5 M parameters, 302 MB of safetensors, 20480 KV bytes per token in fp32) prefills
3072 tokens in fp32 in 3.4 s on the 2-core development VM (AMD EPYC, AVX-512, torch 2.14.0 on
CPU, 2 threads; 3.39 to 3.55 s over 5 runs on an otherwise idle VM), and the 512 tokens left after a
2560-token cached prefix in 0.7 s. The first forward in a process pays one-time set-up, so time
a warm model; under load from other processes the VM's timings grow by 2 to 3x.

Reuse is exact: with SDPA attention in fp32 on that CPU, B prefilled on A's first 2560 tokens of
K/V gives bitwise the same logits, K/V and greedy tokens as a full recompute of B (also for 2500,
2561, 3000, 1 and 16 cached tokens). The one exception seen is a remainder of a single token
(3071 cached): a one-row forward takes other matmul and attention kernels, and the logits (of
magnitude about 6) differ by up to 3e-5. Compare with atol 1e-4: a single cached K row that is
off by 1e-2 in one layer already moves the logits by 6e-4, a one-token position shift by 5.
"""

import hashlib
import json
import os
from pathlib import Path

# The model is always local: never let transformers reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as _hf_logging  # noqa: E402

# Loading and saving would print progress bars on every run of the demo.
_hf_logging.disable_progress_bar()

# Reuse is bitwise exact with both "sdpa" and "eager"; eager materializes every layer's
# [heads, T, T] attention weights (450 MB at 3072 tokens) and is slower.
ATTN_IMPLEMENTATION = "sdpa"

# Written into the model folder after the weights, so its presence means a complete build.
_BUILD_FILE = "gdkv-build.json"

# Config entries that say where, by which transformers version and as what a model was saved or
# loaded ("architectures" is None until saved), not what it computes.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "architectures", "dtype")


def build_model(
    path,
    *,
    seed=0,
    layers=10,
    hidden=768,
    heads=12,
    kv_heads=4,
    intermediate=2048,
    vocab=8192,
    max_positions=8192,
    init_std=0.05,
    sliding_window=0,
):
    """Create a Llama model with random weights from `seed` and save it (safetensors) into `path`.

    Does nothing if `path` already holds a model built with the same arguments. The weights are
    drawn with std `init_std` (transformers' default is 0.02): with 0.02 the untrained model's
    greedy output falls into a loop of 2 tokens after 3 steps; with 0.05 16 greedy steps after a
    3072-token prompt give 16 distinct tokens. `sliding_window` > 0 makes every odd layer a
    sliding-window layer for vLLM (a hybrid model: full and sliding-window attention).

        >>> build_model("/tmp/gdkv-model")
        '/tmp/gdkv-model'
    """
    build = {} if not sliding_window else {"sliding_window": sliding_window}
    build |= {
        "seed": seed,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "vocab": vocab,
        "max_positions": max_positions,
        "init_std": init_std,
    }
    folder = Path(path)
    build_file = folder / _BUILD_FILE
    if build_file.is_file() and json.loads(build_file.read_text()) == build:
        return str(folder)

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
    )
    if sliding_window:
        # Every other layer attends to the last `sliding_window` tokens only: vLLM's Llama reads
        # `layer_types` and `sliding_window` (transformers' own Llama ignores them, so this
        # module's prefill is full attention in every layer).
        config.layer_types = ["full_attention" if i % 2 == 0 else "sliding_attention"
                              for i in range(layers)]
        config.sliding_window = sliding_window
    # fork_rng keeps the caller's global RNG state as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    build_file.unlink(missing_ok=True)
    model.save_pretrained(folder)
    build_file.write_text(json.dumps(build, indent=2) + "\n")
    return str(folder)


def build_tokenizer(path, *, vocab=8192, image_token=None, chat_template=None):
    """Save a tokenizer for a model built by `build_model` into `path` (what an engine such as
    vLLM loads beside the weights; nothing is downloaded or trained).

    It is a word-level vocabulary: id 0 is ``<unk>``, 1 ``<s>`` and 2 ``</s>`` (LlamaConfig's
    bos and eos), and id ``i`` >= 3 is the word ``t<i>``, so the text ``"t17 t4000"`` encodes to
    ``[17, 4000]`` and any token ids decode to text and back. With `image_token`, the last id
    is that special token instead (a vision model's image placeholder). Does nothing if `path`
    already has one built with the same arguments.

        >>> build_tokenizer("/tmp/gdkv-model")
        '/tmp/gdkv-model'
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = Path(path)
    marker = folder / "gdkv-tokenizer.json"
    build = {"vocab": vocab}
    if image_token:
        build |= {"image_token": image_token, "chat_template": chat_template}
    if marker.is_file() and json.loads(marker.read_text()) == build:
        return str(folder)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"t{i}": i for i in range(3, vocab - 1 if image_token else vocab)})
    if image_token:
        words[image_token] = vocab - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    more = {}
    if image_token:   # special: "<image><image>..." as a processor writes it splits into ids
        tok.add_special_tokens([AddedToken(image_token, special=True, normalized=False)])
        more = {"extra_special_tokens": {"image_token": image_token}}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", model_max_length=1 << 20, **more)
    if chat_template:
        fast.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    marker.write_text(json.dumps(build) + "\n")
    return str(folder)


def build_lora_adapter(path, model_path, *, seed=1, rank=8, std=0.05,
                       targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    """Save a LoRA adapter with random weights for the model in `model_path` into `path`, in
    PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``), which vLLM's
    ``--lora-modules name=PATH`` loads. Both LoRA matrices are drawn with std `std` (PEFT starts
    B at zero, which would leave the model's outputs, and its KV, unchanged). It adapts the
    attention projections of every layer, so its KV differs from the base model's from the
    first layer on. Does nothing if `path` holds an adapter built with the same arguments.

        >>> build_lora_adapter("/tmp/gdkv-lora-1", "/tmp/gdkv-model", seed=1)
        '/tmp/gdkv-lora-1'
    """
    from safetensors.torch import save_file

    config = json.loads((Path(model_path) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out = {"q_proj": config["num_attention_heads"] * head_dim, "o_proj": hidden,
           "k_proj": config["num_key_value_heads"] * head_dim,
           "v_proj": config["num_key_value_heads"] * head_dim}
    inp = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden,
           "o_proj": config["num_attention_heads"] * head_dim}
    build = {"seed": seed, "rank": rank, "std": std, "targets": list(targets),
             "model": str(model_path), "config": config}
    folder = Path(path)
    build_file = folder / _BUILD_FILE
    if build_file.is_file() and json.loads(build_file.read_text()) == build:
        return str(folder)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(layers):
        for t in targets:
            name = f"base_model.model.model.layers.{i}.self_attn.{t}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, inp[t], generator=g) * std
            weights[f"{name}.lora_B.weight"] = torch.randn(out[t], rank, generator=g) * std
    folder.mkdir(parents=True, exist_ok=True)
    build_file.unlink(missing_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_path),
        "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "target_modules": list(targets),
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "inference_mode": True}, indent=2) + "\n")
    build_file.write_text(json.dumps(build, indent=2) + "\n")
    return str(folder)


# A vision model's chat template: each message's text and images in order, an image (OpenAI
# "image_url" parts reach the template as {"type": "image"}) as the image token, which the
# processor expands into one token per image patch.
_VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }} "
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<image> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
)


def build_vision_model(path, *, seed=0, layers=4, hidden=512, heads=8, kv_heads=4,
                       intermediate=1024, vocab=8192, max_positions=8192, init_std=0.05,
                       image_size=128, patch=16):
    """Save a LLaVA (a CLIP vision tower, a projector and a Llama) with random weights from
    `seed` into `path`, with its tokenizer (build_tokenizer's, the last id the image token
    ``<image>``), a chat template and its processor: a vision-language model vLLM serves through
    /v1/chat/completions. An image of any size is resized and cropped to `image_size` pixels
    square and becomes (image_size / patch)^2 image tokens (64 by default). Every weight but the
    norms is drawn with std `init_std` (transformers' init leaves the tower's at a scale where
    two images hardly differ). Does nothing if `path` holds one built with the same arguments.

        >>> build_vision_model("/tmp/gdkv-llava")
        '/tmp/gdkv-llava'
    """
    from safetensors.torch import load_file, save_file
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    build = {"vision": True, "seed": seed, "layers": layers, "hidden": hidden, "heads": heads,
             "kv_heads": kv_heads, "intermediate": intermediate, "vocab": vocab,
             "max_positions": max_positions, "init_std": init_std, "image_size": image_size,
             "patch": patch}
    folder = Path(path)
    build_file = folder / _BUILD_FILE
    if build_file.is_file() and json.loads(build_file.read_text()) == build:
        return str(folder)
    text = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                       initializer_range=init_std, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, image_size=image_size, patch_size=patch,
                              projection_dim=64, initializer_range=init_std)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=vocab - 1,
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         projector_hidden_act="gelu", initializer_range=init_std)
    config.vocab_size = vocab
    config.image_seq_length = (image_size // patch) ** 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if "norm" in name:
                    continue
                if name.endswith("bias"):
                    weight.zero_()
                else:
                    weight.normal_(0.0, init_std)
    folder.mkdir(parents=True, exist_ok=True)
    build_file.unlink(missing_ok=True)
    model.save_pretrained(folder)
    # transformers 5.19 names the CLIP tower's weights "vision_tower.embeddings...", vLLM 0.32's
    # LLaVA loader (like the published llava-hf checkpoints) "vision_tower.vision_model....".
    weights_file = folder / "model.safetensors"
    weights = {("vision_tower.vision_model." + k.removeprefix("vision_tower.")
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
                else k): v for k, v in load_file(str(weights_file)).items()}
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    build_tokenizer(folder, vocab=vocab, image_token="<image>",
                    chat_template=_VISION_CHAT_TEMPLATE)
    images = CLIPImageProcessor(size={"shortest_edge": image_size},
                                crop_size={"height": image_size, "width": image_size},
                                do_center_crop=True, do_resize=True, do_normalize=True,
                                do_convert_rgb=True)
    LlavaProcessor(image_processor=images,
                   tokenizer=AutoTokenizer.from_pretrained(folder, local_files_only=True),
                   patch_size=patch, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=_VISION_CHAT_TEMPLATE,
                   image_token="<image>").save_pretrained(folder)
    build_file.write_text(json.dumps(build, indent=2) + "\n")
    return str(folder)


def load_model(path, *, device="cpu", dtype=torch.float32):
    """Load a model saved by `build_model` for inference (eval mode, no gradients, SDPA attention).

        >>> model = load_model("/tmp/gdkv-model")
        >>> model.config.num_hidden_layers, model.dtype
        (10, torch.float32)
    """
    model = LlamaForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True
    )
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def model_identity(model):
    """A name for the model's KV cache contents, to salt cache keys with.

    It is a sha256 over the config, less the entries that differ between a built and a loaded
    model (_VOLATILE_CONFIG_KEYS; the dtype is in the weights), and every weight's name, dtype,
    shape and bytes. So it is equal in every process that loads the same folder with the same
    dtype, and differs for another seed, config or dtype. It takes 0.2 s for the default model.

        >>> model_identity(load_model("/tmp/gdkv-model"))
        'llama-sha256:5a1a9422f3d27f6d37f5e53579d6da1264a5149ce413df8c5f7b3b81580dc3a4'
    """
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    return "llama-sha256:" + digest.hexdigest()


def kv_layout(model):
    """The shape of the model's KV cache; bytes_per_token counts K and V of all layers.

        >>> kv_layout(load_model("/tmp/gdkv-model"))
        {'layers': 10, 'kv_heads': 4, 'head_dim': 64, 'dtype': torch.float32,
         'bytes_per_token': 20480}
    """
    config = model.config
    layers = config.num_hidden_layers
    kv_heads = config.num_key_value_heads
    head_dim = config.head_dim
    dtype = model.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    return {
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "bytes_per_token": layers * 2 * kv_heads * head_dim * itemsize,
    }


def _cache_from(model, past):
    """A DynamicCache holding `past` (per-layer (K, V), each [1, kv_heads, P, head_dim]) as is.

    transformers 5.20.2's DynamicCache(ddp_cache_data=...) would fill its layers through
    DynamicLayer.update, which concatenates onto an empty tensor: a copy. Instead this sets each
    DynamicLayer's `keys`/`values` to the given tensors after `lazy_initialization` (which records
    dtype and device and marks the layer initialized), so no bytes are copied here. The next
    forward's `update` then concatenates the new tokens' K/V onto them into new tensors, so the
    given tensors are only read, never written or kept.
    """
    layout = kv_layout(model)
    if len(past) != layout["layers"]:
        raise ValueError(f"past has {len(past)} layers, the model {layout['layers']}")
    length = past[0][0].shape[2]
    shape = (1, layout["kv_heads"], length, layout["head_dim"])
    for keys, values in past:
        for tensor in (keys, values):
            expected = (shape, layout["dtype"], model.device)
            if (tuple(tensor.shape), tensor.dtype, tensor.device) != expected:
                raise ValueError(
                    f"past tensor {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                    f"expected {shape} {layout['dtype']} on {model.device}"
                )
    cache = DynamicCache(config=model.config)
    for layer, (keys, values) in zip(cache.layers, past):
        layer.lazy_initialization(keys, values)
        layer.keys = keys
        layer.values = values
    return cache


@torch.no_grad()
def prefill(model, input_ids, past=None):
    """Run the model over `input_ids`, after the P tokens whose K/V are in `past` if given.

    `past` is None or a list of per-layer (K, V), each [1, kv_heads, P, head_dim] in the model's
    dtype and device, holding positions 0..P-1; `input_ids` then are the tokens at positions P...
    Returns the logits of the last position (1-D, over the vocabulary) and the cache, which then
    holds all P + len(input_ids) tokens.

        >>> logits, cache = prefill(model, prompt[:2560])
        >>> logits, cache = prefill(model, prompt[2560:], past=layer_kv(cache))
        >>> logits.shape, cache.get_seq_length()
        (torch.Size([8192]), 3072)
    """
    if not input_ids:
        raise ValueError("prefill needs at least one token")
    cache = DynamicCache(config=model.config) if past is None else _cache_from(model, past)
    ids = torch.tensor([input_ids], dtype=torch.long, device=model.device)
    # Without position_ids, LlamaModel numbers the tokens from cache.get_seq_length(), i.e. P.
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], out.past_key_values


def layer_kv(cache):
    """The per-layer (K, V) of a cache, each [1, kv_heads, T, head_dim] (the cache's own tensors).

        >>> [tuple(k.shape) for k, v in layer_kv(cache)][:1]
        [(1, 4, 3072, 64)]
    """
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def greedy(model, cache, logits_last, steps):
    """Greedy decoding of `steps` tokens continuing a prefill that returned `logits_last`.

    tokens[i] is the argmax of logits[i]; logits[0] is `logits_last`, and each later entry comes
    from feeding the previous token, so this runs steps - 1 forwards and appends that many tokens
    to `cache`.

        >>> tokens, logits = greedy(model, cache, logits_last, 16)
        >>> len(tokens), len(logits)
        (16, 16)
    """
    tokens, logits = [], []
    for step in range(steps):
        if step:
            ids = torch.tensor([[tokens[-1]]], dtype=torch.long, device=model.device)
            logits_last = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        logits.append(logits_last)
        tokens.append(int(logits_last.argmax()))
    return tokens, logits
