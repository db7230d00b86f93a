//! `cachalot run`: an offline run from a YAML config (`--config FILE`, or the seed's
//! `--model NAME --yaml FILE` resolving `configs/NAME/FILE`; no arguments: configs/default.yaml).

use std::io::IsTerminal;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use std::sync::Arc;

use cachalot_engine::comm::{share_memory, Communicator, SingleProcess, TcpComm, TcpRendezvous};
use cachalot_model::Fp8Mode;
use cachalot_run::config::RunConfig;
use cachalot_run::offline::{self, RunOptions};

#[derive(clap::Args)]
pub struct RunArgs {
    /// The YAML run config.
    #[arg(long, conflicts_with_all = ["model", "yaml"])]
    config: Option<PathBuf>,
    /// With --yaml: the model's directory under configs/ (the seed's `--model`).
    #[arg(long, requires = "yaml")]
    model: Option<String>,
    /// With --model: the file under configs/NAME/ (the seed's `--yaml`).
    #[arg(long, requires = "model")]
    yaml: Option<PathBuf>,
    /// Directory of run results.
    #[arg(long, default_value = "res")]
    res_dir: PathBuf,
    /// KV pool size in blocks (null block included), instead of the config's sizing.
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Requests in the run (overrides data_config.num_requests).
    #[arg(long)]
    num_requests: Option<usize>,
    /// Chat template instead of the model's: a tokenizer_config.json or a Jinja file.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    #[command(flatten)]
    pub group: GroupArgs,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Print summary.json instead of the table.
    #[arg(long)]
    json: bool,
    /// MTP speculative decoding with N (1-3) drafts per step, 0 to turn it off (overrides
    /// model_config.next_n).
    #[arg(long, value_name = "N")]
    mtp: Option<usize>,
    /// Hold the output head (lm_head) in int8 with int8 activations, as llama.cpp's Q8_0 files
    /// do, instead of the checkpoint's bf16 (recorded as int8_head in summary.json).
    #[arg(long)]
    int8_head: bool,
    /// Multiply bf16 weights as BF16 x BF16, activations rounded to bf16 (AVX-512 `vdpbf16ps`
    /// where the CPU has it), as llama.cpp does (recorded as bf16_dot in summary.json).
    #[arg(long)]
    bf16_dot: bool,
    /// How the KV cache stores its values: bf16 (C16, as the seed: half the memory per cached
    /// token, each value rounded to bf16 when made; DeepSeek-V4's rings too), f32 (exact) or,
    /// for DeepSeek-V4's compact cache, fp8 (compressed entries in e4m3). `auto`: f32 when the
    /// YAML's `model_config.dtype` is float32, else bf16 for the DeepSeek-V3 family and f32 for
    /// DeepSeek-V4 (fp8 when its `platform_version` is 950). Recorded as kv_cache_dtype in
    /// summary.json.
    #[arg(long, value_enum, default_value = "auto")]
    kv_cache_dtype: crate::KvDtypeArg,
    /// Prefix caching (vLLM's automatic prefix caching; the seed has none): a prompt's first
    /// whole KV blocks already computed for an earlier request are shared, not computed again
    /// (outputs unchanged). `auto`: on for DeepSeek-V3/R1/Kimi-K2 without a C8 cache and for
    /// DeepSeek-V4 under `--v4-cache full` (its compact cache, the default, cannot share
    /// blocks), not under force_eplb; off otherwise; `on` refuses a run where it cannot be.
    /// Recorded in summary.json.
    #[arg(long, value_enum, default_value = "auto")]
    prefix_caching: crate::PrefixCachingArg,
    /// DeepSeek-V4's cache layout: compact (compressed entries in the paged pool, the 128-token
    /// window and the compressor inputs in per-sequence rings: bounded memory per sequence)
    /// or full (every position's state in the pool, ~14.5 KiB per token and layer for Flash:
    /// what prefix caching can share). Recorded as v4_cache in summary.json.
    #[arg(long, default_value = "compact")]
    v4_cache: cachalot_model::V4CacheMode,
    #[command(flatten)]
    placement: PlacementArgs,
    /// Read every tensor of the checkpoint before the run and refuse a NaN or infinity (a NaN
    /// FP8 code or E8M0 scale), naming the tensor, as llama.cpp's --check-tensors.
    #[arg(long)]
    check_tensors: bool,
    /// Time the phases of every step (attention's parts, dense MLP, MoE, head, the engine's
    /// own work): a table on stderr and profile.json beside summary.json (this process's
    /// steps: rank 0's in a run over several ranks).
    #[arg(long)]
    profile: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ParallelArg {
    Data,
    Expert,
    Tensor,
    TensorExpert,
    DataExpert,
    Context,
}

/// How a command runs over several processes (`run` and `serve`): `--ranks N` (this process
/// is rank 0 and starts the others on this host) or `--rank R --world-size N --master
/// HOST:PORT` (one process per rank, on any hosts, all with the same options).
#[derive(clap::Args)]
pub(crate) struct GroupArgs {
    /// Threads (per rank; default: all cores, shared out among --ranks or the --host-ranks of
    /// this host; under mpirun: the cores the launcher bound the rank to, or, unbound, the
    /// host's cores shared among its ranks).
    #[arg(long)]
    pub threads: Option<usize>,
    /// N processes on this host: this one is rank 0 (it writes a run's files, or answers a
    /// server's HTTP) and starts the others. With --parallel data each rank serves its share
    /// of the requests; with expert (tensor) the ranks hold the routed experts (the heads and
    /// intermediate features) between them.
    #[arg(long, value_name = "N", conflicts_with_all = ["rank", "world_size", "master"])]
    pub ranks: Option<usize>,
    /// Join a group as this rank (with --world-size and --master; start one process per rank,
    /// on any hosts, all with the same config and options; rank 0 listens on --master).
    #[arg(long, requires_all = ["world_size", "master"])]
    pub rank: Option<usize>,
    /// Ranks in the group joined with --rank.
    #[arg(long, requires_all = ["rank", "master"])]
    pub world_size: Option<usize>,
    /// host:port where rank 0 of the group listens.
    #[arg(long, requires_all = ["rank", "world_size"])]
    pub master: Option<String>,
    /// Ranks of the group on this host, which share its memory budget for the KV cache and its
    /// cores (set by --ranks for the ranks it starts; under mpirun, MPI's count of ranks on
    /// this host; default 1).
    #[arg(long, requires = "rank")]
    pub host_ranks: Option<usize>,
    /// How the ranks share the work: `data` (each rank holds the whole model and serves its
    /// share of the requests) or `expert` (the ranks hold the routed experts between them and
    /// run every request together: a model larger than one host's memory over several;
    /// DeepSeek-V3/R1/Kimi-K2 and V4) or `tensor` (the ranks hold every layer's attention heads
    /// and a share of every MLP's intermediate features, and add their partial outputs twice a
    /// layer; V4 splits whole output groups of heads) or `tensor-expert` (tensor parallel, with the routed
    /// experts split whole over the ranks instead of cut: vLLM's tensor parallelism with
    /// --enable-expert-parallel) or `data-expert` (each rank serves its share of the requests
    /// as with data, and the routed experts are split over the ranks: each MoE layer sends
    /// tokens to their experts' ranks and takes the outputs back; the seed's attention-DP
    /// with expert parallelism, vLLM's data parallelism with --enable-expert-parallel) or
    /// `context` (data-expert, and each prompt's first prefill chunk is cut over all ranks,
    /// each computing its share of the tokens' attention against every rank's latents (V4:
    /// window rows and compressor inputs): the seed's prefill context parallelism, `cp_size`;
    /// DeepSeek-V3/R1/Kimi-K2 and V4).
    /// Without it: the layout of the YAML's `parallel_config` when its world_size is the
    /// number of ranks (attn_tp_size 1 with moe_tp_size 1: data-expert; both world_size:
    /// tensor; attn_tp_size world_size with moe_tp_size 1: tensor-expert), else data.
    #[arg(long, value_enum)]
    pub parallel: Option<ParallelArg>,
    /// How the ranks exchange data: `auto` (through shared memory when every rank of the group
    /// is on one host and can map it, a few µs a collective; payloads larger than a slot go in
    /// slot-sized pieces; TCP otherwise; MPI when an MPI launcher started this process as one of
    /// several ranks) or
    /// `tcp` (TCP through rank 0 for two ranks, every pair linked for three or more; ~60 µs a
    /// collective on a small VM) or `mpi` (the ranks of the MPI job this process belongs to:
    /// start them with `mpirun -n N cachalot …`; needs a build with `--features mpi`).
    #[arg(long, value_enum, default_value = "auto")]
    pub transport: TransportArg,
    /// The MPI world this process joined ([`GroupArgs::join_mpi`]).
    #[arg(skip)]
    pub mpi: Option<Arc<dyn Communicator>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TransportArg {
    Auto,
    Tcp,
    Mpi,
}

impl GroupArgs {
    /// With `--transport mpi`, or `auto` in a process an MPI launcher started: joins the MPI
    /// job (before the thread pool starts, which takes its size from the ranks on this host)
    /// and takes this process's rank, the world size and the ranks on this host from it.
    pub fn join_mpi(&mut self) -> Result<()> {
        use cachalot_engine::comm::{mpi_launch, mpi_world};
        if !self.wants_mpi(mpi_launch())? {
            return Ok(());
        }
        let (comm, host_ranks) = mpi_world().map_err(|e| {
            if self.transport == TransportArg::Auto {
                anyhow!("an MPI launcher started this process (its environment says so), but {e}")
            } else {
                anyhow!("--transport mpi: {e}")
            }
        })?;
        self.rank = Some(comm.rank());
        self.world_size = Some(comm.world_size());
        self.host_ranks = Some(host_ranks);
        self.transport = TransportArg::Mpi;
        self.mpi = Some(comm);
        Ok(())
    }

    /// Whether this process joins an MPI job, given what [`mpi_launch`] says of its launcher:
    /// with `--transport mpi`, or `auto` under a launcher of more than one rank; `--ranks` and
    /// `--rank` are refused there.
    ///
    /// [`mpi_launch`]: cachalot_engine::comm::mpi_launch
    fn wants_mpi(&self, launch: Option<Option<usize>>) -> Result<bool> {
        let want = match self.transport {
            TransportArg::Mpi => true,
            TransportArg::Tcp => false,
            // A launch of one rank is a process on its own.
            TransportArg::Auto => launch.is_some_and(|n| n != Some(1)),
        };
        let why = if self.transport == TransportArg::Mpi {
            "--transport mpi"
        } else {
            "under an MPI launcher"
        };
        if let Some(n) = self.ranks.filter(|_| want) {
            bail!(
                "--ranks {n} {why}: MPI's launcher starts the ranks; give their number to it \
                 (mpirun -n {n} cachalot …) and drop --ranks (or give --transport tcp to run \
                 each launched process as a group of its own)"
            );
        }
        if let Some(r) = self.rank.filter(|_| want) {
            bail!(
                "--rank {r} {why}: MPI's launcher gives each process its rank; drop --rank, \
                 --world-size and --master"
            );
        }
        Ok(want)
    }

    /// Processes in the group: --ranks or --world-size (1 without either).
    pub fn size(&self) -> usize {
        self.ranks.or(self.world_size).unwrap_or(1)
    }

    /// How the ranks share the work: --parallel, or else the layout the YAML's
    /// `parallel_config` names when its world_size is the group's (`Parallel::from_config`;
    /// rank 0 says which), else data parallel.
    pub fn layout(&self, pc: &cachalot_run::config::ParallelConfig) -> Result<offline::Parallel> {
        if let (Some(p), 1) = (self.parallel, self.size()) {
            if !matches!(p, ParallelArg::Data) {
                say!(
                    "note: --parallel {} with one process: nothing is split (give --ranks N, or \
                     --rank/--world-size/--master, for several)",
                    clap::ValueEnum::to_possible_value(&p)
                        .map_or(String::new(), |v| v.get_name().to_string())
                );
            }
        }
        Ok(match self.parallel {
            Some(ParallelArg::Data) => offline::Parallel::Data,
            Some(ParallelArg::Expert) => offline::Parallel::Expert,
            Some(ParallelArg::Tensor) => offline::Parallel::Tensor,
            Some(ParallelArg::TensorExpert) => offline::Parallel::TensorExpert,
            Some(ParallelArg::DataExpert) => offline::Parallel::DataExpert,
            Some(ParallelArg::Context) => offline::Parallel::Context,
            None => {
                match offline::Parallel::from_config(pc, self.size()).map_err(|e| anyhow!("{e}"))? {
                    Some((p, note)) => {
                        if self.size() > 1 && self.rank.unwrap_or(0) == 0 {
                            say!(
                                "cachalot: the config's parallel_config runs as --parallel {}",
                                p.name()
                            );
                            if let Some(n) = note {
                                say!("cachalot: {n}");
                            }
                        }
                        p
                    }
                    None => offline::Parallel::Data,
                }
            }
        })
    }

    /// Threads of this process's pool: --threads, or the cores shared out among --ranks.
    pub fn threads_per_rank(&self) -> Option<usize> {
        let cores = || std::thread::available_parallelism().map_or(1, |c| c.get());
        match (self.threads, self.ranks) {
            (Some(t), _) => Some(t),
            (None, Some(n)) if n > 1 => Some((cores() / n).max(1)),
            // MPI ranks: the cores the launcher bound this one to (Open MPI binds each of up
            // to two ranks to a core, more to a socket: `--bind-to none` or `--map-by
            // socket:PE=N` give more), or, unbound, the host's cores shared among its ranks.
            (None, None) if self.mpi.is_some() => {
                let online = online_cores();
                let allowed = cores();
                Some(if allowed < online {
                    allowed
                } else {
                    (online / self.host_ranks()).max(1)
                })
            }
            // Ranks started by hand, several on this host (`--host-ranks`): its cores shared
            // among them (all of them each would oversubscribe the host).
            (None, None) if self.host_ranks() > 1 => Some((cores() / self.host_ranks()).max(1)),
            _ => None,
        }
    }

    /// Ranks of this group on this host.
    pub fn host_ranks(&self) -> usize {
        self.ranks.or(self.host_ranks).unwrap_or(1).max(1)
    }
}

/// The host's cores (online), whatever this process is bound to.
fn online_cores() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads a system value.
        let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        if n > 0 {
            return n as usize;
        }
    }
    std::thread::available_parallelism().map_or(1, |c| c.get())
}

/// The most ranks `--ranks` starts on one host.
pub(crate) const MAX_RANKS: usize = 1024;

/// How long ranks wait for each other to start.
const RENDEZVOUS: Duration = Duration::from_secs(120);

/// Set in the ranks [`spawn_ranks`] starts: their errors name the rank (rank 0, the command
/// the user ran, says its own without a prefix; an error every rank meets is then told apart).
pub(crate) const SPAWNED_RANK: &str = "CACHALOT_SPAWNED_RANK";

/// Starts ranks 1..n as copies of this command (without --ranks) joining `master` (`run`'s
/// quietly).
fn spawn_ranks(n: usize, master: &str, threads: usize, quiet: bool) -> Result<Vec<(usize, Child)>> {
    let exe = std::env::current_exe()?;
    let mut base = Vec::new();
    let mut it = std::env::args_os().skip(1);
    // The options each rank gets its own of (--host-ranks: --ranks sets it).
    const OWN: [&str; 3] = ["--ranks", "--threads", "--host-ranks"];
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if OWN.contains(&s.as_ref()) {
            it.next();
        } else if !(OWN.iter().any(|o| s.starts_with(&format!("{o}="))) || s == "--quiet") {
            base.push(a);
        }
    }
    let mut children = Vec::new();
    for r in 1..n {
        let mut cmd = Command::new(&exe);
        cmd.args(&base);
        if quiet {
            cmd.arg("--quiet");
        }
        cmd.args(["--rank", &r.to_string(), "--world-size", &n.to_string()])
            .args(["--master", master, "--threads", &threads.to_string()])
            .args(["--host-ranks", &n.to_string()])
            .env(SPAWNED_RANK, r.to_string())
            .stdout(std::process::Stdio::null());
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe; it makes the rank end with
            // this process instead of generating on for nobody.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        match cmd.spawn() {
            Ok(child) => children.push((r, child)),
            Err(e) => {
                end_ranks(children, true);
                bail!("starting rank {r} ({}): {e}", exe.display());
            }
        }
    }
    Ok(children)
}

/// Waits for the ranks this process started (they end on their own once rank 0's sockets
/// close); with `failed`, kills those still running after a grace period (a killed rank cannot
/// clean up, e.g. the random weights of `with_ckpt: false`). The first rank that failed, if any.
pub(crate) fn end_ranks(
    children: Vec<(usize, Child)>,
    failed: bool,
) -> Option<(usize, ExitStatus)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut first_bad = None;
    for (r, mut c) in children {
        let status = loop {
            match c.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if failed && std::time::Instant::now() >= deadline => {
                    let _ = c.kill();
                    break c.wait().ok();
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(_) => break None,
            }
        };
        if let Some(st) = status.filter(|st| !st.success()) {
            first_bad.get_or_insert((r, st));
        }
    }
    first_bad
}

fn config_path(args: &RunArgs) -> Result<PathBuf> {
    let path = match (&args.config, &args.model, &args.yaml) {
        (Some(c), _, _) => c.clone(),
        (None, Some(m), Some(y)) => {
            let dir = PathBuf::from("configs").join(m);
            if !dir.is_dir() {
                let known: Vec<String> = std::fs::read_dir("configs")
                    .map(|rd| {
                        rd.filter_map(|e| e.ok())
                            .filter(|e| e.path().is_dir())
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .collect()
                    })
                    .unwrap_or_default();
                bail!(
                    "--model {m}: no directory {} (models with configs: {})",
                    dir.display(),
                    if known.is_empty() {
                        "none; run from the repository root".into()
                    } else {
                        known.join(", ")
                    }
                );
            }
            dir.join(y)
        }
        _ => PathBuf::from("configs/default.yaml"),
    };
    if path.is_dir() {
        bail!(
            "{}: is a directory; --config takes a YAML run config file",
            path.display()
        );
    }
    if !path.is_file() {
        bail!("{}: no such config file", path.display());
    }
    Ok(path)
}

/// The ranks a process started, by rank.
pub(crate) type Ranks = Vec<(usize, Child)>;

/// The group this process belongs to (a single process without rank options), and the ranks it
/// started (wait for them with [`end_ranks`]); the ranks it starts run this command quietly when
/// `quiet`.
pub(crate) fn connect_ranks(
    group: &GroupArgs,
    quiet: bool,
) -> Result<(Arc<dyn Communicator>, Ranks)> {
    if let Some(comm) = &group.mpi {
        return Ok((comm.clone(), Vec::new()));
    }
    let mut children = Vec::new();
    let comm: Arc<dyn Communicator> = match (group.ranks, group.rank) {
        (Some(n), _) if n > 1 => {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let master = listener.local_addr()?.to_string();
            let threads = group.threads_per_rank().unwrap_or(1);
            children = spawn_ranks(n, &master, threads, quiet)?;
            let mut exited = || {
                children.iter_mut().find_map(|(r, c)| match c.try_wait() {
                    Ok(Some(st)) => Some(format!("rank {r} exited ({st}) before joining")),
                    _ => None,
                })
            };
            match TcpComm::accept_checked(listener, n, RENDEZVOUS, &mut exited)
                .and_then(|c| share_memory(c, group.transport == TransportArg::Auto))
            {
                Ok(c) => c,
                Err(e) => {
                    for (_, c) in &mut children {
                        let _ = c.kill();
                    }
                    bail!("--ranks {n}: {e}");
                }
            }
        }
        (_, Some(rank)) => {
            // Ranks on this host share its cores and KV memory by this count: 1 to the
            // group's size.
            if let (Some(h), Some(w)) = (group.host_ranks, group.world_size) {
                if h == 0 || h > w {
                    bail!(
                        "--host-ranks {h}: the ranks of this group on this host are 1 to \
                         --world-size {w}"
                    );
                }
            }
            let world = group.world_size.unwrap_or(1);
            let master = group.master.clone().unwrap_or_default();
            if !quiet && world > 1 {
                let whom = if rank == 0 {
                    format!("the other {} ranks to join at {master}", world - 1)
                } else {
                    format!("rank 0 at {master}")
                };
                say!(
                    "cachalot: rank {rank} of {world}: waiting up to {} s for {whom}",
                    RENDEZVOUS.as_secs()
                );
            }
            TcpComm::connect(&TcpRendezvous {
                rank,
                world_size: world,
                master,
                timeout: RENDEZVOUS,
            })
            .and_then(|c| share_memory(c, group.transport == TransportArg::Auto))
            .map_err(|e| anyhow!("--rank {rank}: {e}"))?
        }
        _ => Arc::new(SingleProcess),
    };
    Ok((comm, children))
}

/// Expert load balancing options of `run` and `serve`.
#[derive(clap::Args)]
pub struct PlacementArgs {
    /// Expert load balancing: place each MoE layer's routed experts over the expert-parallel
    /// ranks (--parallel expert, tensor-expert, data-expert or context) so that the token
    /// counts of an earlier run of this model (FILE: its summary.json, `expert_load`) fall
    /// evenly on them; every rank gives the same FILE. Outputs are unchanged.
    #[arg(long, value_name = "FILE")]
    pub expert_placement: Option<std::path::PathBuf>,
    /// With --expert-placement under --parallel data-expert or context: N extra copies of each
    /// placed layer's busiest experts (vLLM's num_redundant_experts, DeepSeek EPLB's replicas),
    /// each on another rank; a rank's tokens for such an expert are split in shares over its
    /// copies. The experts split evenly over the ranks, so N is a multiple of the ranks.
    /// Outputs are unchanged.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        requires = "expert_placement"
    )]
    pub redundant_experts: usize,
}

impl PlacementArgs {
    /// The placement for `ranks` ranks under `layout` (refused where the layout does not split
    /// the experts, or copies where it does not dispatch).
    pub fn load(
        &self,
        layout: offline::Parallel,
        ranks: usize,
    ) -> Result<Option<&'static cachalot_model::ExpertPlacement>> {
        use offline::Parallel as P;
        let split = ranks > 1 && matches!(layout, P::Expert | P::TensorExpert);
        let dispatch = ranks > 1 && matches!(layout, P::DataExpert | P::Context);
        offline::expert_placement(
            self.expert_placement.as_deref(),
            self.redundant_experts,
            split,
            dispatch,
            ranks,
        )
        .map_err(|e| anyhow!("{e}"))
    }
}

pub fn run(args: &RunArgs) -> Result<()> {
    if let Some(n) = args.group.ranks.filter(|n| !(1..=MAX_RANKS).contains(n)) {
        bail!("--ranks {n} is out of range: give 1 to {MAX_RANKS}");
    }
    if let Some(n) = args
        .num_requests
        .filter(|n| !(1..=cachalot_run::config::MAX_INT as usize).contains(n))
    {
        bail!(
            "--num-requests {n} is out of range: give 1 to {}",
            cachalot_run::config::MAX_INT
        );
    }
    let path = config_path(args)?;
    let mut cfg = RunConfig::from_file(&path)?;
    if let Some(n) = args.mtp {
        if n > 3 {
            bail!("--mtp {n}: give 1 to 3 draft tokens (0: off)");
        }
        cfg.model_config.next_n = n;
    }
    let opts = RunOptions {
        config_path: path,
        res_dir: args.res_dir.clone(),
        kv_blocks: args.kv_blocks,
        num_requests: args.num_requests,
        chat_template: args.chat_template.clone(),
        progress: !args.quiet && std::io::stderr().is_terminal(),
        fp8: Fp8Mode::Native,
        int8_head: args.int8_head,
        bf16_dot: args.bf16_dot,
        kv_cache_dtype: args.kv_cache_dtype.chosen(),
        prefix_caching: args.prefix_caching.chosen(),
        v4_cache: args.v4_cache,
        host_ranks: args.group.host_ranks(),
        parallel: args.group.layout(&cfg.parallel_config)?,
        expert_placement: args.placement.expert_placement.clone(),
        redundant_experts: args.placement.redundant_experts,
        check_tensors: args.check_tensors,
        mtp_option: args.mtp.is_some(),
    };
    // Ctrl-C or SIGTERM: finished requests are on disk already (requests.rank<R>.partial.jsonl,
    // written as they finish); temporary random weights go.
    crate::term::on_interrupt(|| {
        if let Some(files) = offline::on_interrupt() {
            eprintln!("cachalot run: interrupted; the requests finished so far are in {files}");
        }
    })?;
    // A batch the data-parallel ranks cannot share is said once, before any rank starts.
    let ranks = args.group.size();
    let lockstep = matches!(
        opts.parallel,
        offline::Parallel::Expert | offline::Parallel::Tensor | offline::Parallel::TensorExpert
    );
    let batch = cfg.scheduler_config.batch_size;
    if args.group.rank.is_none() && ranks > 1 && !lockstep && !batch.is_multiple_of(ranks) {
        bail!(
            "{}",
            offline::batch_split_refusal(&opts.config_path, batch, ranks)
        );
    }
    // A placement file or copy count that cannot work is said once, before any rank starts.
    if args.group.rank.is_none() {
        args.placement.load(opts.parallel, ranks)?;
    }
    // So are sizes tensor parallelism cannot split (each rank's load would say it again).
    let tensor = matches!(
        opts.parallel,
        offline::Parallel::Tensor | offline::Parallel::TensorExpert
    );
    let model_dir = std::path::Path::new(&cfg.model_config.model_path);
    if args.group.rank.is_none() && ranks > 1 && tensor && model_dir.join("config.json").is_file() {
        cachalot_model::tensor_parallel::check_model_split(
            model_dir,
            ranks,
            opts.parallel == offline::Parallel::TensorExpert,
        )
        .map_err(|e| anyhow!("{e}"))?;
    }
    // And the routed experts over the ranks of the layouts that split them.
    let experts_split = matches!(
        opts.parallel,
        offline::Parallel::Expert
            | offline::Parallel::TensorExpert
            | offline::Parallel::DataExpert
            | offline::Parallel::Context
    );
    if args.group.rank.is_none()
        && ranks > 1
        && experts_split
        && model_dir.join("config.json").is_file()
    {
        cachalot_model::expert_parallel::check_expert_split(model_dir, ranks)
            .map_err(|e| anyhow!("--parallel {}: {e}", opts.parallel.name()))?;
    }
    let (comm, children) = connect_ranks(&args.group, true)?;
    let (result, totals) = cachalot_model::profile::profiled(args.profile, || {
        offline::run_ranked(&cfg, &opts, comm.clone())
    });
    drop(comm);
    let bad = end_ranks(children, result.is_err());
    let result = result.map_err(|e| anyhow!("{e}"))?;
    if let Some((r, st)) = bad {
        bail!(
            "rank {r} failed ({st}) after the run's files were written to {}; its error is above",
            result.dir.display()
        );
    }
    if args.group.rank.is_some_and(|r| r != 0) {
        return Ok(());
    }
    if args.profile {
        let path = result.dir.join("profile.json");
        std::fs::write(&path, serde_json::to_string_pretty(&totals)? + "\n")
            .map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
        eprint!("{}", cachalot_model::profile::table(&totals));
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result.summary)?);
    } else {
        print!("{}", offline::summary_table(&result.summary));
        println!("results in {}", result.dir.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        group: GroupArgs,
    }

    fn group(args: &[&str]) -> GroupArgs {
        Cmd::try_parse_from(std::iter::once("cachalot").chain(args.iter().copied()))
            .unwrap()
            .group
    }

    #[test]
    fn processes_join_mpi_under_its_launcher_or_when_told() {
        let two = Some(Some(2));
        // Not launched by MPI: only --transport mpi joins (a singleton world).
        assert!(!group(&[]).wants_mpi(None).unwrap());
        assert!(group(&["--transport", "mpi"]).wants_mpi(None).unwrap());
        assert!(!group(&["--ranks", "2"]).wants_mpi(None).unwrap());
        // Under a launcher of two ranks (or of an unknown count): auto joins, tcp does not.
        assert!(group(&[]).wants_mpi(two).unwrap());
        assert!(group(&[]).wants_mpi(Some(None)).unwrap());
        assert!(!group(&["--transport", "tcp"]).wants_mpi(two).unwrap());
        assert!(!group(&["--transport", "tcp", "--ranks", "2"])
            .wants_mpi(two)
            .unwrap());
        // One launched rank is a process on its own.
        assert!(!group(&[]).wants_mpi(Some(Some(1))).unwrap());
        // The launcher starts the ranks: --ranks and --rank are refused by name.
        let e = group(&["--ranks", "2"])
            .wants_mpi(two)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--ranks 2 under an MPI launcher"), "{e}");
        let e = group(&[
            "--transport",
            "mpi",
            "--rank",
            "1",
            "--world-size",
            "2",
            "--master",
            "127.0.0.1:1",
        ])
        .wants_mpi(None)
        .unwrap_err()
        .to_string();
        assert!(e.contains("--rank 1 --transport mpi"), "{e}");
    }

    /// Ranks share their host's cores: those --ranks starts, and those started by hand with
    /// --host-ranks; --threads wins; one rank per host takes them all (the pool's default).
    #[test]
    fn ranks_on_one_host_share_its_cores() {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let share = |n: usize| Some((cores / n).max(1));
        assert_eq!(group(&["--ranks", "2"]).threads_per_rank(), share(2));
        let by_hand = ["--rank", "1", "--world-size", "4", "--master", "h:1"];
        assert_eq!(group(&by_hand).threads_per_rank(), None);
        let two_here = [&by_hand[..], &["--host-ranks", "2"]].concat();
        assert_eq!(group(&two_here).threads_per_rank(), share(2));
        let told = [&two_here[..], &["--threads", "3"]].concat();
        assert_eq!(group(&told).threads_per_rank(), Some(3));
        assert_eq!(group(&[]).threads_per_rank(), None);
    }
}
