//! Command line of `perf`.

use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};
use tokio_rdma::driver::CompletionMode;

/// The six queue-pair tests, named like perftest's binaries, and the two connection-message
/// tests (RDMA CM connections through an `Endpoint`, `Connection::send` / `recv`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    WriteLat,
    SendLat,
    ReadLat,
    WriteBw,
    SendBw,
    ReadBw,
    MsgLat,
    MsgRate,
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
            "msg_lat" | "msg-lat" => Test::MsgLat,
            "msg_rate" | "msg-rate" => Test::MsgRate,
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
            Test::MsgLat => "msg_lat",
            Test::MsgRate => "msg_rate",
        }
    }

    /// A connection-message test (RDMA CM connection, no raw queue pairs).
    pub fn is_msg(self) -> bool {
        matches!(self, Test::MsgLat | Test::MsgRate)
    }

    pub fn is_lat(self) -> bool {
        matches!(
            self,
            Test::WriteLat | Test::SendLat | Test::ReadLat | Test::MsgLat
        )
    }

    /// What one latency sample is (see docs/benchmarks.md).
    pub fn lat_definition(self) -> &'static str {
        match self {
            Test::WriteLat => "half round trip (write + peer's write back, polling memory)",
            Test::SendLat => "half round trip (send ping, receive pong)",
            Test::ReadLat => "one read, post to completion (full round trip)",
            Test::MsgLat => "half round trip (Connection::send ping, Connection::recv pong)",
            Test::MsgRate => "Connection::send start to resolve, under load (not halved)",
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
    /// `owned`: the same loops on `OwnedQp` (one task, a CQ of its own, no driver).
    pub owned: bool,
    /// `batch`: the bandwidth tests on the driver's `AsyncQp` with `AsyncQp::batch` (batches
    /// of up to 16 requests, one future each) instead of a future per request.
    pub batch: bool,
    /// msg tests: send from the connection's registered pool (`Connection::send_bytes`, no
    /// copy) instead of a plain slice (copied into staging buffers).
    pub zero_copy: bool,
    /// msg tests: how large zero-copy messages travel (see [`Rendezvous`]).
    pub rendezvous: Rendezvous,
    /// Rate tests (`*_bw`, `msg_rate`): time every operation (a clock read per operation and
    /// a percentile table). Off by default: perftest's bandwidth tests time the whole run,
    /// and the per-operation clock reads and samples (~120 instructions per operation) would
    /// count as the crate's in `scripts/bench-insn`.
    /// Latency tests always time every iteration.
    pub op_latency: bool,
}

/// msg tests: rendezvous for the messages of `--zero-copy` sends (the crate's threshold,
/// 256 KiB), received with `recv` (a buffer registered per message) or `recv_into` (one pool
/// buffer, reused), or off (chunked through the receive buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Rendezvous {
    Off,
    Recv,
    Into,
}

impl Rendezvous {
    fn name(self) -> &'static str {
        match self {
            Rendezvous::Off => "off",
            Rendezvous::Recv => "recv",
            Rendezvous::Into => "into",
        }
    }
}

impl TestConfig {
    /// One line, `key=value` separated by spaces.
    pub fn encode(&self) -> String {
        let sizes: Vec<String> = self.sizes.iter().map(|s| s.to_string()).collect();
        format!(
            "test={} sizes={} iters={} warmup={} depth={} rx_depth={} qps={} mode={} inline={} signal_every={} coalesce={} engine={} zero_copy={} rendezvous={} op_latency={}",
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
            if self.verbs {
                "verbs"
            } else if self.owned {
                "owned"
            } else if self.batch {
                "batch"
            } else {
                "async"
            },
            u8::from(self.zero_copy),
            self.rendezvous.name(),
            u8::from(self.op_latency),
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
            owned: false,
            batch: false,
            zero_copy: false,
            rendezvous: Rendezvous::Recv,
            op_latency: false,
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
                "engine" => {
                    c.verbs = v == "verbs";
                    c.owned = v == "owned";
                    c.batch = v == "batch";
                }
                "zero_copy" => c.zero_copy = v == "1",
                "op_latency" => c.op_latency = v == "1",
                "rendezvous" => {
                    c.rendezvous = match v {
                        "off" => Rendezvous::Off,
                        "recv" => Rendezvous::Recv,
                        "into" => Rendezvous::Into,
                        _ => return Err(format!("unknown rendezvous mode {v}")),
                    }
                }
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
    CpuOf {
        mark: Option<String>,
        cmd: Vec<String>,
    },
}

/// Which Tokio runtime the process runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RuntimeKind {
    /// `Builder::new_current_thread()`: everything on the main thread.
    Current,
    /// `Builder::new_multi_thread()`, what `#[tokio::main]` builds.
    Multi,
}

#[derive(Debug)]
pub struct Args {
    pub role: Role,
    pub runtime: RuntimeKind,
    /// Client: the loop runs in a spawned task (`--in-task`).
    pub in_task: bool,
    pub device: Option<String>,
    pub json: bool,
    pub svg: Option<String>,
    pub samples: Option<String>,
    pub quiet: bool,
    /// Server: serve this many clients, then exit (0: forever).
    pub clients: usize,
}

const ABOUT: &str = "perftest-style latency and bandwidth benchmark for tokio-rdma";

const LONG_ABOUT: &str = "\
perftest-style latency and bandwidth benchmark for tokio-rdma.

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
  msg_lat    ping-pong of connection messages (Endpoint + RDMA CM connection, Connection::send,
             Connection::recv; compare with ib_send_lat); latency = half a round trip
  msg_rate   a stream of connection messages with --depth messages in flight (the receiver's
             receive credits; compare with ib_send_bw -t DEPTH); the client times first send to
             the receiver's acknowledgement of the last (a 1-byte message back)

For msg_*, the server also listens with RDMA CM on an ephemeral port of the device and tells
the client over the control connection; --inline is the connection's max_inline (default 64,
the crate's default); the queue-pair options (--signal-every, --coalesce, --rx-depth, --qps)
do not apply.

Percentiles come from an HDR histogram of the samples (nanosecond resolution, 3 significant
digits). The rate tests (*_bw, msg_rate) time only the whole run unless --op-latency (or
--samples, --svg) asks for every operation's time, as perftest's bandwidth tests do.";

/// The command line (`perf --help`).
#[derive(Debug, Parser)]
#[command(
    name = "perf",
    about = ABOUT,
    long_about = LONG_ABOUT,
    args_conflicts_with_subcommands = true,
    override_usage = "perf --server [--port P] [--dev NAME] [--clients N]\n       \
                      perf --client HOST [--port P] [--test TEST] [OPTIONS]\n       \
                      perf plot --svg OUT [--title T] NAME=SAMPLES_FILE..."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Run the server: wait for clients on --port
    #[arg(short = 's', long, conflicts_with = "client", help_heading = "Roles")]
    server: bool,
    /// Run the client against the server on HOST
    #[arg(short = 'c', long, value_name = "HOST", help_heading = "Roles")]
    client: Option<String>,
    /// TCP port of the control connection
    #[arg(short = 'p', long, default_value_t = 18600)]
    port: u16,
    /// RDMA device (default: the first with an active port)
    #[arg(short = 'd', long = "dev", value_name = "NAME")]
    device: Option<String>,
    /// Server: serve this many clients, then exit (0: forever)
    #[arg(long, value_name = "N", default_value_t = 1)]
    clients: usize,
    /// Tokio runtime of this process: current (one thread, `new_current_thread`) or multi
    /// (`#[tokio::main]`'s default: a worker per core)
    #[arg(long, value_name = "R", default_value = "current")]
    runtime: RuntimeKind,
    /// Client: run the measuring loop in a task spawned on the runtime rather than in the
    /// future given to `block_on` (see docs/benchmarks-speed-3.md: when another task (the
    /// completion task, in event mode) wakes the `block_on` future, Tokio turns its I/O and
    /// timer drivers once without blocking before polling it, ~1,000 instructions per wake)
    #[arg(long)]
    in_task: bool,
    /// write_lat | send_lat | read_lat | write_bw | send_bw | read_bw | msg_lat | msg_rate
    #[arg(short = 't', long, value_name = "TEST", default_value = "write_lat",
          value_parser = parse_test, help_heading = "Client options")]
    test: Test,
    /// Message size in bytes [default: 2 for latency, 65536 for bandwidth]
    #[arg(long, value_name = "N", conflicts_with_all = ["sizes", "sweep"],
          help_heading = "Client options")]
    size: Option<usize>,
    /// Several sizes in one run
    #[arg(
        long,
        value_name = "A,B,...",
        value_delimiter = ',',
        conflicts_with = "sweep",
        help_heading = "Client options"
    )]
    sizes: Option<Vec<usize>>,
    /// 2 B .. 8 MiB, powers of two (perftest -a)
    #[arg(short = 'a', long, help_heading = "Client options")]
    sweep: bool,
    /// Measured iterations per size and queue pair [default: 1000 latency, 5000 bandwidth]
    #[arg(short = 'n', long, value_name = "N", help_heading = "Client options")]
    iters: Option<usize>,
    /// Unmeasured iterations before each size (like perftest: none)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        help_heading = "Client options"
    )]
    warmup: usize,
    /// Outstanding ops per queue pair in bandwidth tests; msg_rate: messages in flight (the
    /// receiver's receive credits)
    #[arg(
        long,
        value_name = "D",
        default_value_t = 128,
        help_heading = "Client options"
    )]
    depth: usize,
    /// Receives kept posted by the send_bw server
    #[arg(
        long,
        value_name = "R",
        default_value_t = 512,
        help_heading = "Client options"
    )]
    rx_depth: usize,
    /// Queue pairs (bandwidth tests)
    #[arg(
        short = 'q',
        long,
        value_name = "N",
        default_value_t = 1,
        help_heading = "Client options"
    )]
    qps: usize,
    /// busy | adaptive[:SPIN_US] | event; used by both sides
    #[arg(long, value_name = "M", default_value = "busy", value_parser = parse_mode,
          help_heading = "Client options")]
    mode: CompletionMode,
    /// Send payloads up to N bytes inline [default: perftest's, 220 for write_lat, 236 for
    /// send_lat, 0 otherwise]
    #[arg(
        short = 'I',
        long,
        value_name = "N",
        conflicts_with = "no_inline",
        help_heading = "Client options"
    )]
    inline: Option<u32>,
    /// Same as --inline 0
    #[arg(long, help_heading = "Client options")]
    no_inline: bool,
    /// msg tests: send from the connection's registered pool without copying
    /// (Connection::send_bytes; the msg_lat server echoes the received buffer back the same way)
    #[arg(long, help_heading = "Client options")]
    zero_copy: bool,
    /// Rate tests (*_bw, msg_rate): also time every operation (post to completion) and print
    /// its percentiles; off by default, as perftest's bandwidth tests time only the whole run
    #[arg(long, help_heading = "Client options")]
    op_latency: bool,
    /// msg tests with --zero-copy: large messages by rendezvous received with recv (a buffer
    /// registered per message) or recv_into (one pool buffer, reused), or off (chunked)
    #[arg(
        long,
        value_enum,
        default_value = "recv",
        help_heading = "Client options"
    )]
    rendezvous: Rendezvous,
    /// QpOptions::signal_every (the driver's default)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 16,
        help_heading = "Client options"
    )]
    signal_every: u32,
    /// QpOptions::coalesce: on | off [default: off for latency, on for bandwidth]
    #[arg(long, value_name = "on|off", value_parser = parse_on_off,
          help_heading = "Client options")]
    coalesce: Option<bool>,
    /// async: the tokio-rdma driver; owned: the same queue-pair loops (latency and bandwidth,
    /// one queue pair) on an OwnedQp (one task, a CQ of its own); batch: write_bw and send_bw
    /// on the driver's AsyncQp in batches (AsyncQp::batch, one queue pair); verbs: the same
    /// loop on the crate's verbs layer (post + busy-poll the CQ, no driver), a baseline
    #[arg(long, value_name = "E", default_value = "async", value_parser = ["async", "owned", "batch", "verbs"],
          help_heading = "Client options")]
    engine: String,
    /// One JSON object per size on stdout instead of the table
    #[arg(long, help_heading = "Output")]
    json: bool,
    /// Write the latency distribution (CDF) as SVG
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    svg: Option<String>,
    /// Write the raw latency samples (microseconds, one per line)
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    samples: Option<String>,
    /// No progress messages on stderr
    #[arg(long, help_heading = "Output")]
    quiet: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run CMD and print its CPU time (wait4's rusage: user + system, microsecond resolution,
    /// its waited-for children included) as `cpu_of: user_us=U sys_us=S cpu_us=T` on stderr;
    /// exits with CMD's status. scripts/bench-vs-perftest measures perftest with it.
    CpuOf {
        /// Also report the CPU time from the output line containing TEXT to the next line
        /// (perftest: from its results header to its results row, i.e. the measured loop) as
        /// `loop_cpu_us=N`, read from /proc/PID/task/*/schedstat; the command's stdout must be
        /// line-buffered for this (`stdbuf -oL`)
        #[arg(long, value_name = "TEXT")]
        mark: Option<String>,
        /// The command and its arguments
        #[arg(
            value_name = "CMD",
            trailing_var_arg = true,
            allow_hyphen_values = true,
            required = true
        )]
        cmd: Vec<String>,
    },
    /// Plot the latency CDFs of sample files (ours, or perftest's -U output) as SVG
    Plot {
        /// The SVG file to write
        #[arg(long, value_name = "OUT")]
        svg: String,
        /// Title of the plot
        #[arg(long, value_name = "T", default_value = "latency CDF")]
        title: String,
        /// A series: its name and its samples file
        #[arg(value_name = "NAME=FILE", value_parser = parse_series)]
        series: Vec<(String, String)>,
    },
}

fn parse_test(s: &str) -> Result<Test, String> {
    Test::parse(s).ok_or_else(|| format!("unknown test {s}"))
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "1" | "true" => Ok(true),
        "off" | "0" | "false" => Ok(false),
        v => Err(format!("on|off, not {v}")),
    }
}

fn parse_series(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(n, f)| (n.to_string(), f.to_string()))
        .ok_or_else(|| format!("expected NAME=FILE, got {s}"))
}

pub fn parse() -> Args {
    match parse_from(std::env::args().skip(1).collect()) {
        Ok(a) => a,
        Err(e) => e.exit(),
    }
}

pub fn parse_from(argv: Vec<String>) -> Result<Args, clap::Error> {
    let cli = Cli::try_parse_from(std::iter::once("perf".to_string()).chain(argv))?;
    let bad = |msg: &str| Err(Cli::command().error(ErrorKind::ValueValidation, msg));
    if let Some(Command::CpuOf { mark, cmd }) = cli.command {
        return Ok(Args {
            role: Role::CpuOf { mark, cmd },
            runtime: RuntimeKind::Current,
            in_task: false,
            device: None,
            json: false,
            svg: None,
            samples: None,
            quiet: true,
            clients: 0,
        });
    }
    if let Some(Command::Plot { svg, title, series }) = cli.command {
        return Ok(Args {
            role: Role::Plot {
                out: svg,
                title,
                series,
            },
            runtime: RuntimeKind::Current,
            in_task: false,
            device: None,
            json: false,
            svg: None,
            samples: None,
            quiet: true,
            clients: 0,
        });
    }
    let test = cli.test;
    let role = match (cli.server, cli.client) {
        (true, _) => Role::Server { port: cli.port },
        (false, Some(host)) => {
            let sizes = if cli.sweep {
                (1..=23).map(|i| 1usize << i).collect()
            } else if let Some(sizes) = cli.sizes {
                sizes
            } else {
                vec![cli.size.unwrap_or(if test.is_lat() { 2 } else { 65536 })]
            };
            if sizes.iter().any(|&s| s == 0 || s > u32::MAX as usize) {
                return bad("sizes must be between 1 and 4 GiB");
            }
            if test.is_lat() && cli.qps != 1 {
                return bad("latency tests use one queue pair (as perftest's)");
            }
            let default_inline = match test {
                Test::WriteLat => 220,
                Test::SendLat => 236,
                // The connection's default (`Params::default().max_inline`).
                Test::MsgLat | Test::MsgRate => 64,
                _ => 0,
            };
            let verbs = cli.engine == "verbs";
            let owned = cli.engine == "owned";
            let batch = cli.engine == "batch";
            let cfg = TestConfig {
                test,
                sizes,
                iters: cli.iters.unwrap_or(if test.is_lat() { 1000 } else { 5000 }),
                warmup: cli.warmup,
                depth: if test.is_lat() { 1 } else { cli.depth.max(1) },
                rx_depth: cli.rx_depth.max(1),
                qps: cli.qps.max(1),
                mode: cli.mode,
                inline: if cli.no_inline {
                    0
                } else {
                    cli.inline.unwrap_or(default_inline)
                },
                signal_every: cli.signal_every.max(1),
                coalesce: cli.coalesce.unwrap_or(!test.is_lat()),
                verbs,
                owned,
                batch,
                zero_copy: cli.zero_copy,
                rendezvous: cli.rendezvous,
                // The sample file and the plot need the samples.
                op_latency: cli.op_latency
                    || test.is_lat()
                    || cli.samples.is_some()
                    || cli.svg.is_some(),
            };
            if cfg.zero_copy && !test.is_msg() {
                return bad("--zero-copy applies to the msg_* tests");
            }
            if verbs && (!test.is_lat() || test.is_msg()) {
                return bad("--engine verbs exists for the queue-pair latency tests only");
            }
            if owned && (test.is_msg() || cli.qps != 1) {
                return bad("--engine owned runs the queue-pair tests on one queue pair");
            }
            if batch && (!matches!(test, Test::WriteBw | Test::SendBw) || cli.qps != 1) {
                return bad("--engine batch runs write_bw and send_bw on one queue pair");
            }
            if test.is_msg() && cli.qps != 1 {
                return bad("msg_* tests use one connection");
            }
            if cfg.iters < 2 {
                return bad("--iters must be at least 2");
            }
            Role::Client {
                host,
                port: cli.port,
                cfg,
            }
        }
        (false, None) => {
            return Err(Cli::command().error(
                ErrorKind::MissingRequiredArgument,
                "say --server or --client HOST",
            ));
        }
    };
    Ok(Args {
        role,
        runtime: cli.runtime,
        in_task: cli.in_task,
        device: cli.device,
        json: cli.json,
        svg: cli.svg,
        samples: cli.samples,
        quiet: cli.quiet,
        clients: cli.clients,
    })
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
        )
        .unwrap();
        let Role::Client { cfg, .. } = args.role else {
            panic!()
        };
        assert_eq!(TestConfig::decode(&cfg.encode()).unwrap(), cfg);
        assert_eq!(cfg.sizes, [64, 65536]);
        assert_eq!(cfg.inline, 64);
    }

    #[test]
    fn help_and_bad_flags_are_clap_errors() {
        let argv = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        let e = parse_from(argv("--help")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::DisplayHelp);
        assert!(parse_from(argv("--server --client h")).is_err());
        assert!(parse_from(argv("--client h --test send_lat --qps 2")).is_err());
        let a = parse_from(argv("plot --svg o.svg ours=a.txt theirs=b.txt")).unwrap();
        assert!(matches!(a.role, Role::Plot { ref series, .. } if series.len() == 2));
        let a = parse_from(argv("--client h --no-inline -n 10")).unwrap();
        let Role::Client { cfg, .. } = a.role else {
            panic!()
        };
        assert_eq!(
            (cfg.inline, cfg.iters, cfg.sizes.as_slice()),
            (0, 10, &[2][..])
        );
    }

    #[test]
    fn msg_tests_and_cpu_of() {
        let argv = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        let a = parse_from(argv("--client h --test msg_rate --size 64 --depth 64")).unwrap();
        let Role::Client { cfg, .. } = a.role else {
            panic!()
        };
        assert_eq!((cfg.test, cfg.depth, cfg.inline), (Test::MsgRate, 64, 64));
        assert_eq!(TestConfig::decode(&cfg.encode()).unwrap(), cfg);
        let a = parse_from(argv("--client h --test msg_lat --sizes 64,4096")).unwrap();
        let Role::Client { cfg, .. } = a.role else {
            panic!()
        };
        assert!(cfg.test.is_lat() && cfg.test.is_msg() && cfg.depth == 1);
        assert!(parse_from(argv("--client h --test msg_lat --engine verbs")).is_err());
        assert!(parse_from(argv("--client h --test write_bw --engine owned")).is_ok());
        assert!(parse_from(argv("--client h --test write_bw --engine owned --qps 2")).is_err());
        assert!(parse_from(argv("--client h --test msg_rate --engine owned")).is_err());
        assert!(parse_from(argv("--client h --test send_bw --engine batch")).is_ok());
        assert!(parse_from(argv("--client h --test read_bw --engine batch")).is_err());
        assert!(parse_from(argv("--client h --test write_lat --engine batch")).is_err());
        assert!(parse_from(argv("--client h --test write_bw --engine batch --qps 2")).is_err());
        let a = parse_from(argv("cpu-of --mark #bytes -- stdbuf -oL ib_send_lat -e")).unwrap();
        let Role::CpuOf { mark, cmd } = a.role else {
            panic!()
        };
        assert_eq!(mark.as_deref(), Some("#bytes"));
        assert_eq!(cmd, ["stdbuf", "-oL", "ib_send_lat", "-e"]);
        assert!(!a.in_task, "block_on's future by default");
        assert!(parse_from(argv("--client h --in-task")).unwrap().in_task);
    }
}
