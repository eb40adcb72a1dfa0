//! hyper 1.x over the stream: an echo server (the response body is the request body) and
//! clients for HTTP/1.1 keep-alive (small and 1 MiB bodies, one connection) and HTTP/2 (one
//! stream at a time, then several streams multiplexed on one connection). The glue is
//! hyper-util's `TokioIo`, exactly as over a `TcpStream`.

use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::net::{IoObj, Load, Measured, Net, Res, Rows, check, ensure, pair, payload};

/// The echo handler: the response carries the request's body back.
async fn echo(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let body = req.into_body().collect().await?.to_bytes();
    Ok(Response::new(Full::new(body)))
}

/// Serves one HTTP/1.1 connection (keep-alive) until the client hangs up.
async fn serve_h1(io: Box<dyn IoObj>) -> Res<()> {
    hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(io), hyper::service::service_fn(echo))
        .await?;
    Ok(())
}

/// Serves one HTTP/2 connection until the client hangs up; streams run as tasks.
async fn serve_h2(io: Box<dyn IoObj>) -> Res<()> {
    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(io), hyper::service::service_fn(echo))
        .await?;
    Ok(())
}

/// A POST of `payload(seq, size)` to the echo server.
fn request(seq: u64, size: usize) -> Res<Request<Full<Bytes>>> {
    Ok(Request::post("http://stack.invalid/echo")
        .header(hyper::header::HOST, "stack.invalid")
        .body(Full::new(Bytes::from(payload(seq, size))))?)
}

/// Checks a response: status 200 and the body of request `seq`.
async fn check_response(what: &str, seq: u64, size: usize, resp: Response<Incoming>) -> Res<()> {
    ensure!(
        resp.status() == StatusCode::OK,
        "{what} #{seq}: status {}",
        resp.status()
    );
    let body = resp.into_body().collect().await?.to_bytes();
    check(what, seq, size, &body)
}

/// HTTP/1.1 on `net`: rows "HTTP/1.1 small" and "HTTP/1.1 1 MiB", both on one keep-alive
/// connection.
pub async fn run_h1(net: Net, load: Load) -> Res<Rows> {
    let (server, client) = pair(net).await?;
    let server = tokio::spawn(serve_h1(server));
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(client)).await?;
    let conn = tokio::spawn(conn);
    let mut rows = Vec::new();
    let warmup = load.iters.min(100);
    for (name, size, n) in [
        ("HTTP/1.1 small", load.small, load.iters),
        ("HTTP/1.1 1 MiB", 1 << 20, load.large),
    ] {
        let (mut m, mut start) = Measured::start();
        let warm = if size > load.small { 1 } else { warmup.min(n) };
        for seq in 0..warm + n {
            if seq == warm {
                start = Instant::now();
            }
            send.ready().await?;
            let req = request(seq, size)?;
            let t = Instant::now();
            let resp = send.send_request(req).await?;
            check_response(name, seq, size, resp).await?;
            if seq >= warm {
                m.record(t.elapsed());
            }
        }
        m.elapsed = start.elapsed();
        m.bytes = n * size as u64;
        rows.push((name, m));
    }
    // Hanging up: the client connection ends, then the server's, both without an error.
    drop(send);
    conn.await??;
    server.await??;
    Ok(rows)
}

/// HTTP/2 on `net`: row "HTTP/2 small" (one stream at a time) and "HTTP/2 multiplexed"
/// (`load.streams` concurrent streams on the same connection; none if 0).
pub async fn run_h2(net: Net, load: Load) -> Res<Rows> {
    let (server, client) = pair(net).await?;
    let server = tokio::spawn(serve_h2(server));
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client)).await?;
    let conn = tokio::spawn(conn);

    // One client task doing `n` sequential echoes with sequence numbers from `first`.
    let client = move |mut send: hyper::client::conn::http2::SendRequest<Full<Bytes>>,
                       first: u64,
                       n: u64,
                       warmup: u64| async move {
        let (mut m, mut start) = Measured::start();
        for seq in first..first + warmup + n {
            if seq == first + warmup {
                start = Instant::now();
            }
            send.ready().await?;
            let req = request(seq, load.small)?;
            let t = Instant::now();
            let resp = send.send_request(req).await?;
            check_response("HTTP/2 echo", seq, load.small, resp).await?;
            if seq >= first + warmup {
                m.record(t.elapsed());
            }
        }
        m.elapsed = start.elapsed();
        Res::Ok(m)
    };

    let single = client(send.clone(), 0, load.iters, load.iters.min(100)).await?;

    let mut rows = vec![("HTTP/2 small", single)];
    if let Some(per) = load.iters.checked_div(load.streams) {
        let per = per.max(1);
        let start = Instant::now();
        let tasks: Vec<_> = (0..load.streams)
            .map(|i| tokio::spawn(client(send.clone(), 1_000_000 * (i + 1), per, 0)))
            .collect();
        let mut multi = Measured::start().0;
        for t in tasks {
            multi.merge(&t.await??);
        }
        multi.elapsed = start.elapsed();
        rows.push(("HTTP/2 multiplexed", multi));
    }

    drop(send);
    conn.await??;
    server.await??;
    Ok(rows)
}
