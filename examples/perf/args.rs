//! Command line of `perf`.

use std::time::Duration;

use tokio_rdma::driver::CompletionMode;

/// The six tests, named like perftest's binaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    WriteLat,
    SendLat,
    ReadLat,
    WriteBw,
    SendBw,
    ReadBw,
}

impl Test {
    pub fn parse(s: &str) -> Option<Test> {
        Some(match s {
            "write_lat" | "write-lat" => Test::WriteLat,
            "send_lat" | "send-lat" => Test::SendLat,
            "read_lat" | "read-lat" => Test::ReadLat,
            "write_bw" | "write-bw" => Test::WriteBw,
            "send_bw" | "send-bw" => Test::SendBw,
            "read_bw" | "read-bw" => Test::ReadBw,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Test::WriteLat => "write_lat",
            Test::SendLat => "send_lat",
            Test::ReadLat => "read_lat",
            Test::WriteBw => "write_bw",
            Test::SendBw => "send_bw",
            Test::ReadBw => "read_bw",
        }
    }

    pub fn is_lat(self) -> bool {
        matches!(self, Test::WriteLat | Test::SendLat | Test::ReadLat)
    }

    /// What one latency sample is (see docs/benchmarks.md).
    pub fn lat_definition(self) -> &'static str {
        match self {
            Test::WriteLat => "half round trip (write + peer's write back, polling memory)",
            Test::SendLat => "half round trip (send ping, receive pong)",
            Test::ReadLat => "one read, post to completion (full round trip)",
            _ => "post to completion of each op under load (not halved)",
        }
    }
}

pub fn mode_name(m: CompletionMode) -> String {
    match m {
        CompletionMode::BusyPoll => "busy".into(),
        CompletionMode::Event => "event".into(),
        CompletionMode::Adaptive { max_spin } => format!("adaptive:{}", max_spin.as_micros()),
        _ => format!("{m:?}"),
    }
}

pub fn parse_mode(s: &str) -> Result<CompletionMode, String> {
    match s {
        "busy" | "busy-poll" | "busypoll" => Ok(CompletionMode::BusyPoll),
        "event" => Ok(CompletionMode::Event),
        "adaptive" => Ok(CompletionMode::default()),
        _ => match s.strip_prefix("adaptive:") {
            Some(us) => us
                .parse::<u64>()
                .map(|us| CompletionMode::Adaptive {
                    max_spin: Duration::from_micros(us),
                })
                .map_err(|_| format!("bad spin in {s}: adaptive:MICROSECONDS")),
            None => Err(format!("unknown mode {s}: busy, adaptive[:US], event")),
        },
    }
}

/// Parameters of a test, decided by the client and sent to the server.
#[derive(Debug, Clone, PartialEq)]
pub struct TestConfig {
    pub test: Test,
    pub sizes: Vec<usize>,
    pub iters: usize,
    pub warmup: usize,
    /// Outstanding operations per queue pair (bandwidth tests).
    pub depth: usize,
    /// Receives kept posted by the send_bw server.
    pub rx_depth: usize,
    pub qps: usize,
    pub mode: CompletionMode,
    /// Largest payload sent inline (0: inline off).
    pub inline: u32,
    pub signal_every: u32,
    pub coalesce: bool,
    /// `verbs`: the same loop on the crate's verbs layer, without the async driver (a
    /// baseline that separates the driver's cost from the bindings' and the device's).
    pub verbs: bool,
}

impl TestConfig {
    /// One line, `key=value` separated by spaces.
    pub fn encode(&self) -> String {
        let sizes: Vec<String> = self.sizes.iter().map(|s| s.to_string()).collect();
        format!(
            "test={} sizes={} iters={} warmup={} depth={} rx_depth={} qps={} mode={} inline={} signal_every={} coalesce={} engine={}",
            self.test.name(),
            sizes.join(","),
            self.iters,
            self.warmup,
            self.depth,
            self.rx_depth,
            self.qps,
            mode_name(self.mode),
            self.inline,
            self.signal_every,
            u8::from(self.coalesce),
            if self.verbs { "verbs" } else { "async" },
        )
    }

    pub fn decode(line: &str) -> Result<TestConfig, String> {
        let mut c = TestConfig {
            test: Test::WriteLat,
            sizes: vec![],
            iters: 0,
            warmup: 0,
            depth: 1,
            rx_depth: 1,
            qps: 1,
            mode: CompletionMode::BusyPoll,
            inline: 0,
            signal_every: 1,
            coalesce: false,
            verbs: false,
        };
        for kv in line.split_whitespace() {
            let (k, v) = kv.split_once('=').ok_or(format!("bad field {kv}"))?;
            let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{k}: {e}"));
            match k {
                "test" => c.test = Test::parse(v).ok_or(format!("unknown test {v}"))?,
                "sizes" => {
                    c.sizes = v.split(',').map(num).collect::<Result<_, _>>()?;
                }
                "iters" => c.iters = num(v)?,
                "warmup" => c.warmup = num(v)?,
                "depth" => c.depth = num(v)?,
                "rx_depth" => c.rx_depth = num(v)?,
                "qps" => c.qps = num(v)?,
                "mode" => c.mode = parse_mode(v)?,
                "inline" => c.inline = num(v)? as u32,
                "signal_every" => c.signal_every = num(v)? as u32,
                "coalesce" => c.coalesce = v == "1",
                "engine" => c.verbs = v == "verbs",
                _ => return Err(format!("unknown field {k}")),
            }
        }
        if c.sizes.is_empty() || c.iters == 0 || c.qps == 0 || c.depth == 0 {
            return Err(format!("incomplete configuration: {line}"));
        }
        Ok(c)
    }

    pub fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(1).max(1)
    }
}

#[derive(Debug)]
pub enum Role {
    Server {
        port: u16,
    },
    Client {
        host: String,
        port: u16,
        cfg: TestConfig,
    },
    Plot {
        out: String,
        title: String,
        series: Vec<(String, String)>,
    },
}

#[derive(Debug)]
pub struct Args {
    pub role: Role,
    pub device: Option<String>,
    pub json: bool,
    pub svg: Option<String>,
    pub samples: Option<String>,
    pub quiet: bool,
    /// Server: serve this many clients, then exit (0: forever).
    pub clients: usize,
}

pub const USAGE: &str = "\
perf: perftest-style latency and bandwidth benchmark for tokio-rdma.

Usage:
  perf --server [--port P] [--dev NAME] [--clients N]
  perf --client HOST [--port P] [--test TEST] [OPTIONS]
  perf plot --svg OUT [--title T] NAME=SAMPLES_FILE...

Like perftest it runs as two processes: the server waits on a TCP port (default 18600), the
client connects, sends the test configuration, and both exchange queue-pair endpoints and a
remote token for a registered buffer, connect RC queue pairs on the first active device (or
--dev), run the test, and the client prints the results.

Tests (--test, default write_lat):
  write_lat  ping-pong of RDMA WRITEs, each side polling the last byte of its buffer (like
             ib_write_lat); latency = half a round trip
  send_lat   ping-pong of SENDs (like ib_send_lat); latency = half a round trip
  read_lat   one RDMA READ at a time (like ib_read_lat); latency = one full read
  write_bw, send_bw, read_bw
             --depth operations outstanding per queue pair (like ib_*_bw); bandwidth in MiB/s
             (perftest's MB/sec), message rate in Mop/s, and each op's post-to-completion time

Client options:
  --size N           message size in bytes (default 2 for latency, 65536 for bandwidth)
  --sizes A,B,...    several sizes in one run
  --sweep            2 B .. 8 MiB, powers of two (perftest -a)
  --iters N          measured iterations per size and queue pair (default 1000 lat, 5000 bw)
  --warmup N         unmeasured iterations before each size (default 0, like perftest)
  --depth D          outstanding ops per queue pair in bandwidth tests (default 128)
  --rx-depth R       receives kept posted by the send_bw server (default 512)
  --qps N            queue pairs (bandwidth tests; default 1)
  --mode M           busy | adaptive[:SPIN_US] | event (default busy); used by both sides
  --inline N         send payloads up to N bytes inline (default: perftest's, 220 for write_lat,
                     236 for send_lat, 0 otherwise); --no-inline = --inline 0
  --signal-every N   QpOptions::signal_every (default 16, the driver's default)
  --coalesce on|off  QpOptions::coalesce (default off for latency, on for bandwidth)
  --engine E         async (default): the tokio-rdma driver; verbs: the same latency loop on
                     the crate's verbs layer (post + busy-poll the CQ, no driver), a baseline
  --json             one JSON object per size on stdout instead of the table
  --svg FILE         write the latency distribution (CDF) as SVG
  --samples FILE     write the raw latency samples (microseconds, one per line)
  --quiet            no progress messages on stderr
";

fn bad(msg: impl std::fmt::Display) -> ! {
    eprintln!("perf: {msg}\n\n{USAGE}");
    std::process::exit(2);
}

pub fn parse() -> Args {
    parse_from(std::env::args().skip(1).collect())
}

pub fn parse_from(argv: Vec<String>) -> Args {
    let mut it = argv.into_iter().peekable();
    if it.peek().map(String::as_str) == Some("plot") {
        it.next();
        let (mut out, mut title, mut series) = (None, String::from("latency CDF"), vec![]);
        while let Some(a) = it.next() {
            match a.as_str() {
                "--svg" => out = it.next(),
                "--title" => title = it.next().unwrap_or_else(|| bad("--title needs a value")),
                s => match s.split_once('=') {
                    Some((n, f)) => series.push((n.to_string(), f.to_string())),
                    None => bad(format!("plot: expected NAME=FILE, got {s}")),
                },
            }
        }
        let out = out.unwrap_or_else(|| bad("plot needs --svg OUT"));
        return Args {
            role: Role::Plot { out, title, series },
            device: None,
            json: false,
            svg: None,
            samples: None,
            quiet: true,
            clients: 0,
        };
    }

    let (mut server, mut host, mut port) = (false, None, 18600u16);
    let mut test = Test::WriteLat;
    let (mut sizes, mut sweep): (Option<Vec<usize>>, bool) = (None, false);
    let (mut iters, mut warmup, mut depth, mut rx_depth, mut qps) = (None, 0, 128, 512, 1);
    let mut mode = CompletionMode::BusyPoll;
    let (mut inline, mut signal_every, mut coalesce) = (None, 16u32, None);
    let mut verbs = false;
    let mut a = Args {
        role: Role::Server { port },
        device: None,
        json: false,
        svg: None,
        samples: None,
        quiet: false,
        clients: 1,
    };
    while let Some(arg) = it.next() {
        let mut val = || {
            it.next()
                .unwrap_or_else(|| bad(format!("{arg} needs a value")))
        };
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> T {
            v.parse()
                .unwrap_or_else(|_| bad(format!("{flag}: not a number: {v}")))
        }
        match arg.as_str() {
            "--server" | "-s" => server = true,
            "--client" | "-c" => host = Some(val()),
            "--port" | "-p" => port = num("--port", val()),
            "--dev" | "-d" => a.device = Some(val()),
            "--clients" => a.clients = num("--clients", val()),
            "--test" | "-t" => {
                let v = val();
                test = Test::parse(&v).unwrap_or_else(|| bad(format!("unknown test {v}")))
            }
            "--size" => sizes = Some(vec![num("--size", val())]),
            "--sizes" => {
                sizes = Some(
                    val()
                        .split(',')
                        .map(|s| num("--sizes", s.to_string()))
                        .collect(),
                )
            }
            "--sweep" | "-a" => sweep = true,
            "--iters" | "-n" => iters = Some(num("--iters", val())),
            "--warmup" => warmup = num("--warmup", val()),
            "--depth" => depth = num("--depth", val()),
            "--rx-depth" => rx_depth = num("--rx-depth", val()),
            "--qps" | "-q" => qps = num("--qps", val()),
            "--mode" => mode = parse_mode(&val()).unwrap_or_else(|e| bad(e)),
            "--inline" | "-I" => inline = Some(num("--inline", val())),
            "--no-inline" => inline = Some(0),
            "--signal-every" => signal_every = num("--signal-every", val()),
            "--coalesce" => {
                coalesce = Some(match val().as_str() {
                    "on" | "1" | "true" => true,
                    "off" | "0" | "false" => false,
                    v => bad(format!("--coalesce on|off, not {v}")),
                })
            }
            "--engine" => {
                verbs = match val().as_str() {
                    "verbs" => true,
                    "async" => false,
                    v => bad(format!("--engine async|verbs, not {v}")),
                }
            }
            "--json" => a.json = true,
            "--svg" => a.svg = Some(val()),
            "--samples" => a.samples = Some(val()),
            "--quiet" => a.quiet = true,
            "-h" | "--help" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => bad(format!("unknown argument {other}")),
        }
    }
    a.role = match (server, host) {
        (true, None) => Role::Server { port },
        (false, Some(host)) => {
            let sizes = if sweep {
                (1..=23).map(|i| 1usize << i).collect()
            } else {
                sizes.unwrap_or_else(|| vec![if test.is_lat() { 2 } else { 65536 }])
            };
            if sizes.iter().any(|&s| s == 0 || s > u32::MAX as usize) {
                bad("sizes must be between 1 and 4 GiB");
            }
            if test.is_lat() && qps != 1 {
                bad("latency tests use one queue pair (as perftest's)");
            }
            let default_inline = match test {
                Test::WriteLat => 220,
                Test::SendLat => 236,
                _ => 0,
            };
            let cfg = TestConfig {
                test,
                sizes,
                iters: iters.unwrap_or(if test.is_lat() { 1000 } else { 5000 }),
                warmup,
                depth: if test.is_lat() { 1 } else { depth.max(1) },
                rx_depth: rx_depth.max(1),
                qps: qps.max(1),
                mode,
                inline: inline.unwrap_or(default_inline),
                signal_every: signal_every.max(1),
                coalesce: coalesce.unwrap_or(!test.is_lat()),
                verbs,
            };
            if verbs && !test.is_lat() {
                bad("--engine verbs exists for the latency tests only");
            }
            if cfg.iters < 2 {
                bad("--iters must be at least 2");
            }
            Role::Client { host, port, cfg }
        }
        (true, Some(_)) => bad("--server and --client exclude each other"),
        (false, None) => bad("say --server or --client HOST"),
    };
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_round_trips() {
        let args = parse_from(
            "--client h --test send_bw --sizes 64,65536 --qps 2 --mode adaptive:80 --inline 64"
                .split(' ')
                .map(String::from)
                .collect(),
        );
        let Role::Client { cfg, .. } = args.role else {
            panic!()
        };
        assert_eq!(TestConfig::decode(&cfg.encode()).unwrap(), cfg);
    }
}
