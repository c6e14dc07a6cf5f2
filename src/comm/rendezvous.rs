//! How ranks started by a launcher find each other.
//!
//! A launcher (`torchrun`, `mpirun` with a wrapper, a job script) sets `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` in every process. Without `WORLD_SIZE`, a
//! task that Slurm's `srun` started (`SLURM_STEP_ID` set) takes its place from Slurm's own:
//! `SLURM_PROCID` the rank, `SLURM_STEP_NUM_TASKS` (else `SLURM_NTASKS`) the world size,
//! `SLURM_LOCALID` the local rank (0 for a task that sees one GPU, `CUDA_VISIBLE_DEVICES` of
//! one entry, as `srun --gpus-per-task 1` binds it), and the first host of the step's nodes
//! (`SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`, in Slurm's `node[01-04,07]` form) rank
//! 0's address; `MASTER_ADDR` and the ports below still win where set. Rank 0 listens on
//! `MASTER_PORT` (on every interface, so a `MASTER_ADDR` that names the node resolves to a
//! reachable address even where the node's own name maps to loopback) and serves the group's
//! 128-byte NCCL unique id to each other rank: a client sends the magic `TIDEMEM1`, its rank and
//! the world size (u32 little-endian each), and reads the 128 bytes back. Clients resolve
//! `MASTER_ADDR` again and try each of its addresses on every attempt until the timeout, so the
//! ranks may start in any order and before the name resolves. `TIDEMEM_MASTER_PORT`, when set,
//! replaces `MASTER_PORT` (for launchers whose own store holds `MASTER_PORT`, as `torchrun`'s
//! agent does). A job of one rank exchanges nothing.
//!
//! ```
//! use std::time::Duration;
//! use tidemem::comm::{exchange_id, LaunchEnv};
//! # fn main() -> tidemem::Result<()> {
//! let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
//! let env = move |rank| LaunchEnv {
//!     rank,
//!     world_size: 2,
//!     local_rank: rank,
//!     master_addr: "127.0.0.1".into(),
//!     master_port: port,
//! };
//! let t = std::thread::spawn(move || exchange_id(&env(1), None, Duration::from_secs(10)));
//! let root = exchange_id(&env(0), Some([7u8; 128]), Duration::from_secs(10))?;
//! assert_eq!(t.join().unwrap()?, root);
//! # Ok(()) }
//! ```

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"TIDEMEM1";

/// A rank's place in a launched job, from the launcher's environment: `torchrun`'s variables
/// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), or, without
/// `WORLD_SIZE`, those of a task Slurm's `srun` started (`SLURM_STEP_ID` set): `SLURM_PROCID`
/// the rank, `SLURM_STEP_NUM_TASKS` (else `SLURM_NTASKS`) the world size, `SLURM_LOCALID` the
/// local rank (0 for a task that sees one GPU, `CUDA_VISIBLE_DEVICES` of one entry, as
/// `srun --gpus-per-task 1` binds it), and the first host of the step's nodes
/// (`SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`, in Slurm's `node[01-04,07]` form) rank
/// 0's address; `MASTER_ADDR` and the ports still win where set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank (`RANK`).
    pub rank: usize,
    /// Number of ranks (`WORLD_SIZE`).
    pub world_size: usize,
    /// Rank on this node, which picks the GPU (`LOCAL_RANK`, default: `RANK`).
    pub local_rank: usize,
    /// Host of rank 0 (`MASTER_ADDR`, default `127.0.0.1`).
    pub master_addr: String,
    /// Port rank 0 listens on (`TIDEMEM_MASTER_PORT`, else `MASTER_PORT`, default 29500).
    pub master_port: u16,
}

impl LaunchEnv {
    /// This process's place in a launched job, from the environment (`torchrun`'s variables,
    /// else Slurm's under `srun`: see [`LaunchEnv`]); `Ok(None)` when no launcher
    /// started it. Malformed or inconsistent values are [`Error::Rendezvous`] naming the
    /// variable.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get`; `Ok(None)` when neither `WORLD_SIZE` nor an `srun`
    /// task's Slurm variables are present. Malformed or inconsistent values are errors naming
    /// the variable.
    pub(crate) fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        if get("WORLD_SIZE").is_none() && get("SLURM_STEP_ID").is_some() {
            return Self::from_slurm(&get);
        }
        Self::from_torchrun(&get)
    }

    /// The place from `torchrun`'s variables; `Ok(None)` without `WORLD_SIZE`.
    fn from_torchrun(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let Some(world) = get("WORLD_SIZE") else {
            return Ok(None);
        };
        let num = |k: &str, v: String| -> Result<usize> {
            v.trim()
                .parse()
                .map_err(|_| Error::Rendezvous(format!("{k}={v:?} is not a number")))
        };
        let world_size = num("WORLD_SIZE", world)?;
        let rank = num(
            "RANK",
            get("RANK")
                .ok_or_else(|| Error::Rendezvous("WORLD_SIZE is set but RANK is not".into()))?,
        )?;
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => num("LOCAL_RANK", v)?,
            None => rank,
        };
        if world_size == 0 || rank >= world_size {
            return Err(Error::Rendezvous(format!(
                "RANK={rank} is not below WORLD_SIZE={world_size}"
            )));
        }
        let port_var = ["TIDEMEM_MASTER_PORT", "MASTER_PORT"]
            .into_iter()
            .find_map(|k| get(k).map(|v| (k, v)));
        let master_port = match port_var {
            Some((k, v)) => {
                let p = num(k, v)?;
                u16::try_from(p)
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| Error::Rendezvous(format!("{k}={p} is not a port")))?
            }
            None => 29500,
        };
        Ok(Some(LaunchEnv {
            rank,
            world_size,
            local_rank,
            master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
        }))
    }

    /// An `srun` task's place from Slurm's variables, as `torchrun`'s would give it: the
    /// rank, world size and local rank read under torchrun's names, `MASTER_ADDR` the first
    /// host of the step's nodes unless set.
    fn from_slurm(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let need = |k: &str| {
            get(k).ok_or_else(|| Error::Rendezvous(format!("SLURM_STEP_ID is set but {k} is not")))
        };
        let world = match get("SLURM_STEP_NUM_TASKS") {
            Some(n) => n,
            None => need("SLURM_NTASKS")?,
        };
        let rank = need("SLURM_PROCID")?;
        // a task bound to one GPU (`--gpus-per-task 1`) sees it as device 0
        let one_gpu =
            get("CUDA_VISIBLE_DEVICES").is_some_and(|v| !v.trim().is_empty() && !v.contains(','));
        let local = match one_gpu {
            true => Some("0".to_string()),
            false => get("SLURM_LOCALID"),
        };
        let addr = match get("MASTER_ADDR") {
            Some(a) => a,
            None => {
                let (k, list) = [
                    "SLURM_STEP_NODELIST",
                    "SLURM_JOB_NODELIST",
                    "SLURM_NODELIST",
                ]
                .into_iter()
                .find_map(|k| get(k).map(|v| (k, v)))
                .ok_or_else(|| {
                    Error::Rendezvous(
                        "SLURM_STEP_ID is set but no node list (SLURM_STEP_NODELIST, \
                             SLURM_JOB_NODELIST) names rank 0's host, and MASTER_ADDR is not set"
                            .into(),
                    )
                })?;
                first_host(&list)
                    .ok_or_else(|| Error::Rendezvous(format!("{k}={list:?} names no host")))?
            }
        };
        let renamed = |k: &str| match k {
            "WORLD_SIZE" => Some(world.clone()),
            "RANK" => Some(rank.clone()),
            "LOCAL_RANK" => local.clone(),
            "MASTER_ADDR" => Some(addr.clone()),
            other => get(other),
        };
        Self::from_torchrun(&renamed).map_err(|e| match e {
            Error::Rendezvous(m) => Error::Rendezvous(format!(
                "{m} (from Slurm: WORLD_SIZE is SLURM_STEP_NUM_TASKS or SLURM_NTASKS, RANK \
                 SLURM_PROCID, LOCAL_RANK SLURM_LOCALID)"
            )),
            e => e,
        })
    }

    /// Every address `MASTER_ADDR:port` resolves to now.
    fn addrs(&self) -> std::result::Result<Vec<SocketAddr>, String> {
        let v: Vec<SocketAddr> = (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| format!("MASTER_ADDR {}: {e}", self.master_addr))?
            .collect();
        if v.is_empty() {
            return Err(format!("MASTER_ADDR {} has no address", self.master_addr));
        }
        Ok(v)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io {
            during: "an I/O operation",
            source: e,
        }
    }
}

fn io(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Rendezvous(format!("{what}: {e}"))
}

/// Shares rank 0's `id` with every rank: rank 0 passes `Some(id)` and serves it until all other
/// ranks have it; the others pass `None` and get it. Fails after `timeout` with the ranks that
/// never came (rank 0) or the reason rank 0 could not be reached.
pub fn exchange_id(env: &LaunchEnv, id: Option<[u8; 128]>, timeout: Duration) -> Result<[u8; 128]> {
    let deadline = super::deadline_after(timeout);
    if env.rank == 0 {
        let id = id.ok_or_else(|| Error::Rendezvous("rank 0 must provide the id".into()))?;
        if env.world_size > 1 {
            serve(env, id, deadline)?;
        }
        return Ok(id);
    }
    let mut last = String::from("no attempt");
    while Instant::now() < deadline {
        match env.addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    // a failed exchange (rank 0 busy or restarting) is retried like a refusal
                    match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                        Ok(s) => match fetch(env, s, deadline) {
                            Ok(id) => return Ok(id),
                            Err(e) => last = format!("{addr}: {e}"),
                        },
                        Err(e) => last = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(Error::Rendezvous(format!(
        "rank {} could not reach rank 0 at {}:{} within {} ms: {last}",
        env.rank,
        env.master_addr,
        env.master_port,
        timeout.as_millis()
    )))
}

fn fetch(env: &LaunchEnv, mut s: TcpStream, deadline: Instant) -> Result<[u8; 128]> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).map_err(io("socket"))?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
    s.write_all(&hello).map_err(io("sending to rank 0"))?;
    let mut id = [0u8; 128];
    s.read_exact(&mut id)
        .map_err(io("reading the id from rank 0"))?;
    Ok(id)
}

fn serve(env: &LaunchEnv, id: [u8; 128], deadline: Instant) -> Result<()> {
    // Listen on every interface of the family MASTER_ADDR resolves to (IPv4 if it does not).
    let v6 = env
        .addrs()
        .ok()
        .and_then(|a| a.first().copied())
        .is_some_and(|a| a.is_ipv6());
    let any: std::net::IpAddr = if v6 {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    };
    let addr = SocketAddr::new(any, env.master_port);
    let l = TcpListener::bind(addr).map_err(io("rank 0 listening"))?;
    l.set_nonblocking(true).map_err(io("rank 0 listening"))?;
    let mut seen = vec![false; env.world_size];
    seen[0] = true;
    let mut strangers = Vec::new();
    while seen.iter().any(|s| !s) {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (0..env.world_size).filter(|&r| !seen[r]).collect();
            let also = if strangers.is_empty() {
                String::new()
            } else {
                format!(
                    "; ignored clients announcing (rank, world) {strangers:?}, this job has \
                     WORLD_SIZE={}",
                    env.world_size
                )
            };
            return Err(Error::Rendezvous(format!(
                "rank 0 waited for ranks {missing:?} at {addr} until the timeout{also}"
            )));
        }
        match l.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(io("socket"))?;
                s.set_read_timeout(Some(Duration::from_secs(5)))
                    .map_err(io("socket"))?;
                let mut hello = [0u8; 16];
                if s.read_exact(&mut hello).is_err() || &hello[..8] != MAGIC {
                    continue; // not one of ours
                }
                let rank = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes")) as usize;
                let world = u32::from_le_bytes(hello[12..16].try_into().expect("4 bytes")) as usize;
                if world != env.world_size || rank == 0 || rank >= world || seen[rank] {
                    // another job's rank, a misconfigured one, or a second process with a
                    // rank already served: named if ours never come
                    strangers.push((rank, world));
                    continue;
                }
                // a client that hangs up before reading is not served; it retries
                if s.write_all(&id).is_ok() {
                    seen[rank] = true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(io("accepting")(e)),
        }
    }
    Ok(())
}

/// The first host of a Slurm host list: `node[01-04,07],gpu3` → `node01` (the first entry,
/// each bracket replaced by its first value, zero padding kept); `None` for an empty or
/// malformed list.
fn first_host(list: &str) -> Option<String> {
    let mut host = String::new();
    let mut rest = list.trim();
    loop {
        let stop = rest.find([',', '[']).unwrap_or(rest.len());
        host.push_str(&rest[..stop]);
        rest = &rest[stop..];
        if !rest.starts_with('[') {
            break;
        }
        let close = rest.find(']')?;
        let first = rest[1..close].split([',', '-']).next()?.trim();
        if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(v: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| v.iter().find(|(a, _)| *a == k).map(|(_, b)| b.to_string())
    }

    #[test]
    fn environment_is_parsed_and_checked() {
        assert_eq!(LaunchEnv::from_vars(vars(&[])).unwrap(), None);
        let e = LaunchEnv::from_vars(vars(&[("WORLD_SIZE", "4"), ("RANK", "2")]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.master_port),
            (2, 4, 2, 29500)
        );
        assert_eq!(e.master_addr, "127.0.0.1");
        let e = LaunchEnv::from_vars(vars(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("MASTER_PORT", "29400"),
            ("TIDEMEM_MASTER_PORT", "29411"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(e.master_port, 29411, "TIDEMEM_MASTER_PORT wins");
        for bad in [
            vec![("WORLD_SIZE", "4")],
            vec![("WORLD_SIZE", "4"), ("RANK", "4")],
            vec![("WORLD_SIZE", "x"), ("RANK", "0")],
            vec![("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "70000")],
            vec![("WORLD_SIZE", "0"), ("RANK", "0")],
        ] {
            assert!(
                matches!(LaunchEnv::from_vars(vars(&bad)), Err(Error::Rendezvous(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn an_srun_task_takes_its_place_from_slurm() {
        let task = [
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "gpu[007-010,12],login1"),
            ("SLURM_JOB_NODELIST", "other1"),
        ];
        let e = LaunchEnv::from_vars(vars(&task)).unwrap().unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (5, 8, 1));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("gpu007", 29500));
        let mut bound = task.to_vec();
        bound.push(("CUDA_VISIBLE_DEVICES", "3"));
        let e = LaunchEnv::from_vars(vars(&bound)).unwrap().unwrap();
        assert_eq!(
            e.local_rank, 0,
            "a task bound to one GPU sees it as device 0"
        );
        // torchrun's variables win; MASTER_ADDR and the port are read as ever
        let mut both = task.to_vec();
        both.extend([("MASTER_ADDR", "head"), ("MASTER_PORT", "29411")]);
        let e = LaunchEnv::from_vars(vars(&both)).unwrap().unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("head", 29411));
        both.extend([("WORLD_SIZE", "2"), ("RANK", "1")]);
        let e = LaunchEnv::from_vars(vars(&both)).unwrap().unwrap();
        assert_eq!((e.rank, e.world_size), (1, 2));
        // a batch script's shell (no step) is not a rank
        let batch = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8")];
        assert_eq!(LaunchEnv::from_vars(vars(&batch)).unwrap(), None);
        for bad in [
            vec![("SLURM_STEP_ID", "0"), ("SLURM_NTASKS", "2")],
            vec![
                ("SLURM_STEP_ID", "0"),
                ("SLURM_PROCID", "2"),
                ("SLURM_NTASKS", "2"),
            ],
            vec![
                ("SLURM_STEP_ID", "0"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
            ],
            vec![
                ("SLURM_STEP_ID", "0"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_JOB_NODELIST", "n[x-y]"),
            ],
        ] {
            let e = LaunchEnv::from_vars(vars(&bad));
            assert!(matches!(e, Err(Error::Rendezvous(_))), "{bad:?}: {e:?}");
        }
    }

    #[test]
    fn slurm_host_lists_give_their_first_host() {
        for (list, first) in [
            ("node1", Some("node1")),
            ("node[01-04,07],gpu3", Some("node01")),
            ("a[3,1]-ib[2-4]", Some("a3-ib2")),
            ("x1,x2", Some("x1")),
            ("", None),
            ("n[", None),
            ("n[]", None),
        ] {
            assert_eq!(first_host(list).as_deref(), first, "{list}");
        }
    }

    #[test]
    fn every_rank_gets_rank_zeros_id_and_a_missing_rank_times_out() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let env = move |rank, world| LaunchEnv {
            rank,
            world_size: world,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        };
        let id: [u8; 128] = std::array::from_fn(|i| i as u8);
        let t = Duration::from_secs(20);
        let got: Vec<[u8; 128]> = std::thread::scope(|s| {
            // clients first: they retry until rank 0 listens
            let hs: Vec<_> = (1..4)
                .map(|r| s.spawn(move || exchange_id(&env(r, 4), None, t)))
                .collect();
            std::thread::sleep(Duration::from_millis(100));
            let root = exchange_id(&env(0, 4), Some(id), t).unwrap();
            let mut v = vec![root];
            v.extend(hs.into_iter().map(|h| h.join().unwrap().unwrap()));
            v
        });
        assert!(got.iter().all(|g| *g == id));
        // rank 1 of 2 never comes; a client of another job (world 3) is ignored and named
        let stranger =
            std::thread::spawn(move || exchange_id(&env(1, 3), None, Duration::from_millis(600)));
        let e = exchange_id(&env(0, 2), Some(id), Duration::from_millis(400)).unwrap_err();
        assert!(e.to_string().contains("[1]"), "{e}");
        assert!(e.to_string().contains("(1, 3)"), "{e}");
        assert!(stranger.join().unwrap().is_err());
        // one rank: nothing to exchange, nothing bound (the port may be taken)
        let _taken = TcpListener::bind(("127.0.0.1", port)).unwrap();
        assert_eq!(
            exchange_id(&env(0, 1), Some(id), Duration::from_millis(100)).unwrap(),
            id
        );
        // nobody listens
        let e = exchange_id(&env(1, 2), None, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, Error::Rendezvous(_)), "{e}");
    }
}
