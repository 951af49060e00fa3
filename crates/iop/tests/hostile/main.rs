#[path = "../common/mod.rs"]
mod common;
mod http;
