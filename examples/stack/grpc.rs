//! A tonic gRPC service and client over the stream, without protoc and without tonic's
//! transport feature: the messages are hand-written prost structs, the service is tonic's
//! `server::Grpc` inside a hyper HTTP/2 server, the client is tonic's `client::Grpc` over a
//! hyper HTTP/2 connection. What `tonic-build` would generate is the dispatch by path
//! ([`route`]) and the typed client calls ([`EchoClient`]); both are short.
//!
//! Methods of `stack.Echo`: `Unary` (the reply carries the request's payload back) and
//! `Stream` (server streaming: `count` replies of `size` bytes, reply `i` with the pattern of
//! `seq + i`). Every payload is checked.

use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use http::uri::{PathAndQuery, Uri};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tonic::server::{Grpc, ServerStreamingService, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use crate::net::{IoObj, Load, Measured, Net, Res, Rows, check, ensure, pair, payload};

/// `stack.EchoRequest`, as prost-build would generate it from
/// `message EchoRequest { uint64 seq = 1; bytes payload = 2; uint32 count = 3; uint32 size = 4; }`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoRequest {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(bytes = "bytes", tag = "2")]
    pub payload: Bytes,
    #[prost(uint32, tag = "3")]
    pub count: u32,
    #[prost(uint32, tag = "4")]
    pub size: u32,
}

/// `stack.EchoReply`: `message EchoReply { uint64 seq = 1; bytes payload = 2; }`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoReply {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(bytes = "bytes", tag = "2")]
    pub payload: Bytes,
}

const UNARY: &str = "/stack.Echo/Unary";
const STREAM: &str = "/stack.Echo/Stream";

/// The `Unary` method.
#[derive(Debug, Clone, Copy)]
struct Unary;

impl UnaryService<EchoRequest> for Unary {
    type Response = EchoReply;
    type Future = Ready<Result<Response<EchoReply>, Status>>;

    fn call(&mut self, req: Request<EchoRequest>) -> Self::Future {
        let req = req.into_inner();
        ready(Ok(Response::new(EchoReply {
            seq: req.seq,
            payload: req.payload,
        })))
    }
}

/// The `Stream` method.
#[derive(Debug, Clone, Copy)]
struct Numbers;

impl ServerStreamingService<EchoRequest> for Numbers {
    type Response = EchoReply;
    type ResponseStream = BoxStream<'static, Result<EchoReply, Status>>;
    type Future = Ready<Result<Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, req: Request<EchoRequest>) -> Self::Future {
        let req = req.into_inner();
        let (first, size) = (req.seq, req.size as usize);
        let replies = futures::stream::iter(0..u64::from(req.count)).map(move |i| {
            Ok(EchoReply {
                seq: first + i,
                payload: Bytes::from(payload(first + i, size)),
            })
        });
        ready(Ok(Response::new(replies.boxed())))
    }
}

/// The server's dispatch by path (what tonic-build generates for a service).
async fn route(req: http::Request<Incoming>) -> Result<http::Response<tonic::body::Body>, Status> {
    let codec = ProstCodec::<EchoReply, EchoRequest>::default();
    Ok(match req.uri().path() {
        UNARY => Grpc::new(codec).unary(Unary, req).await,
        STREAM => Grpc::new(codec).server_streaming(Numbers, req).await,
        _ => Status::unimplemented("no such method").into_http(),
    })
}

/// Serves gRPC on one connection (HTTP/2) until the client hangs up.
async fn serve(io: Box<dyn IoObj>) -> Res<()> {
    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(io), hyper::service::service_fn(route))
        .await?;
    Ok(())
}

/// A hyper HTTP/2 connection as the `tower::Service` tonic's client takes (tonic's transport
/// `Channel` is one too; this needs no `transport` feature).
#[derive(Debug, Clone)]
struct H2(hyper::client::conn::http2::SendRequest<tonic::body::Body>);

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<Incoming>, hyper::Error>> + Send>>;

impl tower_service::Service<http::Request<tonic::body::Body>> for H2 {
    type Response = http::Response<Incoming>;
    type Error = hyper::Error;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), hyper::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> ResponseFuture {
        Box::pin(self.0.send_request(req))
    }
}

/// The typed client (what tonic-build generates as `EchoClient`).
#[derive(Debug, Clone)]
struct EchoClient(tonic::client::Grpc<H2>);

impl EchoClient {
    async fn unary(&mut self, req: EchoRequest) -> Result<EchoReply, Status> {
        self.0
            .ready()
            .await
            .map_err(|e| Status::unknown(e.to_string()))?;
        let codec = ProstCodec::<EchoRequest, EchoReply>::default();
        let path = PathAndQuery::from_static(UNARY);
        Ok(self
            .0
            .unary(Request::new(req), path, codec)
            .await?
            .into_inner())
    }

    async fn stream(&mut self, req: EchoRequest) -> Result<tonic::Streaming<EchoReply>, Status> {
        self.0
            .ready()
            .await
            .map_err(|e| Status::unknown(e.to_string()))?;
        let codec = ProstCodec::<EchoRequest, EchoReply>::default();
        let path = PathAndQuery::from_static(STREAM);
        Ok(self
            .0
            .server_streaming(Request::new(req), path, codec)
            .await?
            .into_inner())
    }
}

/// gRPC on `net`: rows "gRPC unary small" (sequential calls) and "gRPC server streaming"
/// (replies per second over calls of `load.stream_msgs` replies each).
pub async fn run(net: Net, load: Load) -> Res<Rows> {
    let (server, client) = pair(net).await?;
    let server = tokio::spawn(serve(server));
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client)).await?;
    let conn = tokio::spawn(conn);
    let origin = Uri::from_static("http://stack.invalid");
    let mut echo = EchoClient(tonic::client::Grpc::with_origin(H2(send), origin));

    let warmup = load.iters.min(100);
    let (mut unary, mut start) = Measured::start();
    for seq in 0..warmup + load.iters {
        if seq == warmup {
            start = Instant::now();
        }
        let req = EchoRequest {
            seq,
            payload: Bytes::from(payload(seq, load.small)),
            count: 0,
            size: 0,
        };
        let t = Instant::now();
        let reply = echo.unary(req).await?;
        let d = t.elapsed();
        ensure!(reply.seq == seq, "gRPC unary #{seq}: reply #{}", reply.seq);
        check("gRPC unary", seq, load.small, &reply.payload)?;
        if seq >= warmup {
            unary.record(d);
        }
    }
    unary.elapsed = start.elapsed();

    // Server streaming: calls of `stream_msgs` replies; each call's latency is recorded.
    let calls = (load.iters / 10).max(2);
    let (mut streaming, start) = Measured::start();
    let mut replies = 0;
    for call in 0..calls {
        let first = 1_000_000 * (call + 1);
        let n = load.stream_msgs;
        let req = EchoRequest {
            seq: first,
            payload: Bytes::new(),
            count: u32::try_from(n)?,
            size: u32::try_from(load.small)?,
        };
        let t = Instant::now();
        let mut stream = echo.stream(req).await?;
        let mut i = 0;
        while let Some(reply) = stream.message().await? {
            ensure!(
                reply.seq == first + i,
                "gRPC stream: reply #{} where #{} was due",
                reply.seq,
                first + i
            );
            check("gRPC stream", first + i, load.small, &reply.payload)?;
            i += 1;
        }
        ensure!(i == n, "gRPC stream call {call}: {i} of {n} replies");
        streaming
            .hist
            .saturating_record(t.elapsed().as_nanos() as u64);
        replies += i;
    }
    streaming.elapsed = start.elapsed();
    streaming.requests = replies;
    streaming.bytes = replies * load.small as u64;

    drop(echo);
    conn.await??;
    server.await??;
    Ok(vec![
        ("gRPC unary small", unary),
        ("gRPC server streaming", streaming),
    ])
}
