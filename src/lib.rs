//! tokio-rdma
#[allow(dead_code)]
mod sys;
