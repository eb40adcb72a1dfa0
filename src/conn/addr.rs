//! Addresses as Tokio's networking types take them: a `SocketAddr`, an `"IP:port"` string, a
//! `(host, port)` pair or a host name, resolved before any RDMA CM call.

use std::net::SocketAddr;

use tokio::net::ToSocketAddrs;

use crate::error::{Error, Result};

/// Every address `addr` resolves to, in the resolver's order (at least one).
pub(crate) async fn resolve(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Vec<SocketAddr>> {
    let what = format!("{addr:?}");
    let found: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|source| Error::LookupHost {
            what: what.clone(),
            source,
        })?
        .collect();
    if found.is_empty() {
        return Err(Error::LookupHost {
            what,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no address"),
        });
    }
    Ok(found)
}

/// Tries `f` on every address `addr` resolves to, in order, until one succeeds; the last
/// error otherwise (as `TcpStream::connect` does).
pub(crate) async fn first_ok<T, F, Fut>(
    addr: impl ToSocketAddrs + std::fmt::Debug,
    mut f: F,
) -> Result<T>
where
    F: FnMut(SocketAddr) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut last = None;
    for a in resolve(addr).await? {
        match f(a).await {
            Ok(v) => return Ok(v),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("resolve gives at least one address"))
}
