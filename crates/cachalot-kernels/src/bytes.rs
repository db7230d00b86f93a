//! Immutable byte storage for weights: an owned buffer, or a window into a shared owner such as
//! an mmap'd safetensors shard (spec `deepseek-v3-r1-kimi-k2.md` §2: a 700 GB checkpoint is
//! mapped, never read into RAM twice).
//!
//! Safetensors data offsets carry no alignment guarantee, so every reader of these bytes uses
//! unaligned little-endian loads.

use std::fmt;
use std::sync::Arc;

use crate::KernelError;

/// What keeps `path`, named as a shard, from being read as one, where it exists in some form:
/// a directory, a symbolic link to nothing (a Hugging Face cache whose blob is gone), a FIFO,
/// socket or device (reading one would block or never end). None for a regular file (through
/// links) and for nothing at all (the caller says which entry names it).
pub fn shard_file_problem(path: &std::path::Path) -> Option<String> {
    let link = std::fs::symlink_metadata(path).ok()?;
    match std::fs::metadata(path) {
        Err(_) if link.file_type().is_symlink() => Some(format!(
            "is a symbolic link to {}, which does not exist: fetch the shard again (in a \
             Hugging Face cache, its blob is gone)",
            std::fs::read_link(path)
                .map(|t| t.display().to_string())
                .unwrap_or_else(|_| "?".into())
        )),
        Err(e) => Some(format!("cannot be read ({e})")),
        Ok(m) if m.is_dir() => Some("is a directory, not a safetensors shard".into()),
        Ok(m) if !m.is_file() => {
            Some("is not a regular file (a FIFO, socket or device): a shard must be a file".into())
        }
        Ok(_) => None,
    }
}

/// What a [`Bytes`] window can share: an owned buffer, an mmap'd file, ...
pub type ByteOwner = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Immutable byte storage: owned, or a window into a shared owner (e.g. an mmap'd safetensors
/// shard). Cloning is cheap (a reference count).
#[derive(Clone)]
pub struct Bytes {
    owner: ByteOwner,
    start: usize,
    len: usize,
}

impl Bytes {
    /// Owns `v`.
    pub fn from_vec(v: Vec<u8>) -> Bytes {
        let len = v.len();
        Bytes {
            owner: Arc::new(v),
            start: 0,
            len,
        }
    }

    /// The window `start..start + len` of `owner`, bounds-checked.
    pub fn from_owner(owner: ByteOwner, start: usize, len: usize) -> Result<Bytes, KernelError> {
        let owner_len = (*owner).as_ref().len();
        match start.checked_add(len) {
            Some(end) if end <= owner_len => Ok(Bytes { owner, start, len }),
            _ => Err(KernelError::WindowOutOfBounds {
                start,
                len,
                owner_len,
            }),
        }
    }

    /// The sub-window `start..start + len` of this window (sharing the owner), bounds-checked.
    pub fn window(&self, start: usize, len: usize) -> Result<Bytes, KernelError> {
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(Bytes {
                owner: self.owner.clone(),
                start: self.start + start,
                len,
            }),
            _ => Err(KernelError::WindowOutOfBounds {
                start,
                len,
                owner_len: self.len,
            }),
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsRef<[u8]> for Bytes {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bytes({} bytes at offset {})", self.len, self.start)
    }
}

/// A stored value type that can hold a value that is not a number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredFloat {
    Bf16,
    F16,
    F32,
    /// FP8 e4m3fn: codes 0x7F and 0xFF are NaN.
    E4m3,
    /// A power-of-two scale: 255 is NaN.
    E8m0,
}

/// The first element of `bytes` (little-endian values of `kind`) that is not a number: a NaN or
/// infinity, a NaN code or scale; None when every one is a number.
pub fn first_non_finite(kind: StoredFloat, bytes: &[u8]) -> Option<usize> {
    let at = |size: usize, f: fn(&[u8]) -> bool| bytes.chunks_exact(size).position(f);
    match kind {
        StoredFloat::Bf16 => at(2, |b| u16::from_le_bytes([b[0], b[1]]) & 0x7F80 == 0x7F80),
        StoredFloat::F16 => at(2, |b| u16::from_le_bytes([b[0], b[1]]) & 0x7C00 == 0x7C00),
        StoredFloat::F32 => at(4, |b| {
            !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()
        }),
        StoredFloat::E4m3 => at(1, |b| b[0] & 0x7F == 0x7F),
        StoredFloat::E8m0 => at(1, |b| b[0] == 255),
    }
}

/// The little-endian bytes of `values` (to build test and converted matrices).
pub fn f32s_to_le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The little-endian bytes of 16-bit values (bf16 or f16 bit patterns).
pub fn u16s_to_le_bytes(values: &[u16]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_bounds_checked() {
        let owner: ByteOwner = Arc::new(vec![1u8, 2, 3, 4, 5]);
        let b = Bytes::from_owner(owner.clone(), 1, 3).unwrap();
        assert_eq!(b.as_slice(), &[2, 3, 4]);
        assert_eq!(b.window(1, 2).unwrap().as_slice(), &[3, 4]);
        assert!(b.window(2, 2).is_err());
        assert!(Bytes::from_owner(owner.clone(), 3, 3).is_err());
        assert!(Bytes::from_owner(owner.clone(), usize::MAX, 2).is_err());
        let e = Bytes::from_owner(owner, 4, 2).unwrap_err().to_string();
        assert!(e.contains("outside its owner of 5 bytes"), "{e}");
        assert!(Bytes::from_vec(vec![]).is_empty());
    }
}
