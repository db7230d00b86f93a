//! The paged KV block pool and the per-request block tables (spec `executor.md` §3.3–§3.4).
//!
//! - Block 0 is the null block: never handed out, and freeing it is a no-op (padding and unused
//!   table entries point at it, as in the seed system).
//! - Allocation is all-or-nothing: a request either gets every block it asks for in one call or
//!   none, so a failed allocation never leaves a half-grown table behind.
//! - Freed blocks go to the back of a FIFO queue, so a block just freed is the last to be reused
//!   (easier to spot a stale read in a test than LIFO reuse).
//!
//! The DeepSeek-V3 family has one cache type (the latent cache, every layer sharing one block
//! table), so one pool serves all of a model's layers; a family with several cache types (V4)
//! will hold one [`BlockPool`] per type behind the same all-or-nothing [`KvBlockManager`] call.

use std::collections::{HashMap, VecDeque};

/// The null block's id.
pub const NULL_BLOCK: u32 = 0;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("block {0} is freed twice or was never handed out")]
    DoubleFree(u32),
    #[error("block {0} is outside the pool of {1} blocks")]
    OutOfRange(u32, usize),
}

/// Fixed-size blocks `1..num_blocks` handed out and taken back.
#[derive(Debug, Clone)]
pub struct BlockPool {
    num_blocks: usize,
    free: VecDeque<u32>,
    is_free: Vec<bool>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, the first of which is the reserved null block (so
    /// `num_blocks - 1` are usable). `num_blocks` must be at least 2.
    pub fn new(num_blocks: usize) -> BlockPool {
        assert!(num_blocks >= 2, "a pool needs the null block and one more");
        let mut is_free = vec![true; num_blocks];
        is_free[0] = false;
        BlockPool {
            num_blocks,
            free: (1..num_blocks as u32).collect(),
            is_free,
        }
    }

    /// All blocks, the null block included (the size of the cache tensor).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Blocks that can ever be handed out.
    pub fn capacity(&self) -> usize {
        self.num_blocks - 1
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn num_used(&self) -> usize {
        self.capacity() - self.free.len()
    }

    /// `n` blocks, or `None` (and nothing taken) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let out: Vec<u32> = self.free.drain(..n).collect();
        for &b in &out {
            self.is_free[b as usize] = false;
        }
        Some(out)
    }

    /// Returns blocks to the pool; the null block is ignored, a double free is an error (and
    /// nothing is freed).
    pub fn free(&mut self, blocks: &[u32]) -> Result<(), PoolError> {
        let mut seen = std::collections::HashSet::new();
        for &b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            if b as usize >= self.num_blocks {
                return Err(PoolError::OutOfRange(b, self.num_blocks));
            }
            if self.is_free[b as usize] || !seen.insert(b) {
                return Err(PoolError::DoubleFree(b));
            }
        }
        for &b in blocks {
            if b != NULL_BLOCK {
                self.is_free[b as usize] = true;
                self.free.push_back(b);
            }
        }
        Ok(())
    }

    pub fn is_free(&self, block: u32) -> bool {
        self.is_free.get(block as usize).copied().unwrap_or(false)
    }
}

/// How many blocks fit in a byte budget, given the bytes one block takes across all layers.
/// The result counts the null block, and is at least 2 (one usable block).
pub fn blocks_for_budget(budget_bytes: u64, bytes_per_block: u64) -> usize {
    ((budget_bytes / bytes_per_block.max(1)) as usize).max(2)
}

/// Block tables of the requests holding cache, over one [`BlockPool`].
#[derive(Debug, Clone)]
pub struct KvBlockManager {
    pool: BlockPool,
    block_size: usize,
    tables: HashMap<u64, Vec<u32>>,
    peak_used: usize,
}

impl KvBlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> KvBlockManager {
        assert!(block_size > 0, "block_size must be positive");
        KvBlockManager {
            pool: BlockPool::new(num_blocks),
            block_size,
            tables: HashMap::new(),
            peak_used: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    /// Tokens the whole pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.capacity() * self.block_size
    }
    /// The most blocks held at once since the start.
    pub fn peak_used(&self) -> usize {
        self.peak_used
    }

    /// Blocks a request must hold to cover `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// More blocks `req` needs to cover `tokens` positions.
    pub fn blocks_needed(&self, req: u64, tokens: usize) -> usize {
        let held = self.tables.get(&req).map_or(0, Vec::len);
        self.blocks_for(tokens).saturating_sub(held)
    }

    /// Grows `req`'s table to cover `tokens` positions; false (and nothing allocated) when the
    /// pool has too few free blocks.
    pub fn allocate_slots(&mut self, req: u64, tokens: usize) -> bool {
        let need = self.blocks_needed(req, tokens);
        if need == 0 {
            return true;
        }
        match self.pool.allocate(need) {
            Some(blocks) => {
                self.tables.entry(req).or_default().extend(blocks);
                self.peak_used = self.peak_used.max(self.pool.num_used());
                true
            }
            None => false,
        }
    }

    pub fn block_table(&self, req: u64) -> &[u32] {
        self.tables.get(&req).map_or(&[], Vec::as_slice)
    }

    /// Shrinks `req`'s table to the blocks that cover `tokens` positions, returning the rest to
    /// the pool (speculative decoding: blocks held only for rejected drafts). Returns how many
    /// blocks were released.
    pub fn trim(&mut self, req: u64, tokens: usize) -> usize {
        let keep = self.blocks_for(tokens);
        let Some(table) = self.tables.get_mut(&req) else {
            return 0;
        };
        if table.len() <= keep {
            return 0;
        }
        let tail = table.split_off(keep);
        if table.is_empty() {
            self.tables.remove(&req);
        }
        self.pool
            .free(&tail)
            .expect("a request's table holds blocks only it owns");
        tail.len()
    }

    /// Releases every block `req` holds (nothing if it holds none).
    pub fn free(&mut self, req: u64) {
        if let Some(t) = self.tables.remove(&req) {
            self.pool
                .free(&t)
                .expect("a request's table holds blocks only it owns");
        }
    }

    /// Requests holding blocks.
    pub fn holders(&self) -> impl Iterator<Item = (&u64, &Vec<u32>)> {
        self.tables.iter()
    }

    /// Checks that every block is either free or held by exactly one request, and the null
    /// block by none. For tests and debug assertions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut owner: Vec<Option<u64>> = vec![None; self.pool.num_blocks()];
        for (&req, table) in &self.tables {
            for &b in table {
                if b == NULL_BLOCK {
                    return Err(format!("request {req} holds the null block"));
                }
                if self.pool.is_free(b) {
                    return Err(format!("request {req} holds free block {b}"));
                }
                if let Some(o) = owner[b as usize].replace(req) {
                    return Err(format!("block {b} is held by {o} and {req}"));
                }
            }
        }
        let held = owner.iter().filter(|o| o.is_some()).count();
        if held + self.pool.num_free() != self.pool.capacity() {
            return Err(format!(
                "{held} held + {} free != {} usable: blocks leaked",
                self.pool.num_free(),
                self.pool.capacity()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_block_is_never_handed_out() {
        let mut p = BlockPool::new(4);
        assert_eq!(p.capacity(), 3);
        let b = p.allocate(3).unwrap();
        assert!(!b.contains(&NULL_BLOCK));
        assert_eq!(p.allocate(1), None);
        p.free(&[NULL_BLOCK]).unwrap();
        assert_eq!(p.num_free(), 0);
    }

    #[test]
    fn allocation_is_all_or_nothing_and_double_free_is_refused() {
        let mut p = BlockPool::new(5);
        let a = p.allocate(3).unwrap();
        assert_eq!(p.allocate(2), None);
        assert_eq!(p.num_free(), 1);
        p.free(&a).unwrap();
        assert_eq!(p.free(&a[..1]), Err(PoolError::DoubleFree(a[0])));
        assert_eq!(p.free(&[9]), Err(PoolError::OutOfRange(9, 5)));
        assert_eq!(p.num_free(), 4);
    }

    #[test]
    fn freed_blocks_are_reused_last() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(1).unwrap();
        p.free(&a).unwrap();
        assert_eq!(p.allocate(3).unwrap(), vec![2, 3, 1]);
    }

    #[test]
    fn manager_grows_tables_by_blocks() {
        let mut m = KvBlockManager::new(5, 4);
        assert!(m.allocate_slots(7, 5));
        assert_eq!(m.block_table(7).len(), 2);
        assert!(m.allocate_slots(7, 8));
        assert_eq!(m.block_table(7).len(), 2);
        assert!(!m.allocate_slots(8, 9), "3 blocks wanted, 2 free");
        assert!(m.block_table(8).is_empty());
        assert!(m.allocate_slots(8, 8));
        assert_eq!(m.peak_used(), 4);
        m.free(7);
        m.check_invariants().unwrap();
        assert_eq!(m.pool().num_free(), 2);
    }

    #[test]
    fn trim_returns_the_tail_blocks() {
        let mut m = KvBlockManager::new(6, 4);
        assert!(m.allocate_slots(1, 13));
        assert_eq!(m.block_table(1).len(), 4);
        assert_eq!(m.trim(1, 9), 1);
        assert_eq!(m.block_table(1).len(), 3);
        assert_eq!(m.trim(1, 12), 0);
        assert_eq!(m.trim(1, 0), 3);
        assert!(m.holders().next().is_none());
        assert_eq!(m.trim(9, 0), 0);
        m.check_invariants().unwrap();
        assert_eq!(m.pool().num_free(), 5);
    }

    #[test]
    fn budget_sizes_the_pool() {
        assert_eq!(blocks_for_budget(1000, 100), 10);
        assert_eq!(blocks_for_budget(10, 100), 2);
    }
}
