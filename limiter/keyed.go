package limiter

import (
	"encoding/binary"
	"hash/maphash"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
)

// table is a keyed limit's buckets: one GCRA pool per key, with a cache
// of tokens leased from it (no shard per processor: a million keys cannot
// each hold one), in a bounded table.
//
// The table is split in up to tableShards shards by a seeded hash of the
// key (hash/maphash, a seed per table), so that a client cannot choose
// keys that all land in one shard, and each shard holds at most its part
// of maxKeys (the parts add up to maxKeys exactly). A shard that is full
// evicts, of a few keys sampled from a random place, the one whose bucket
// is fullest (smallest tat): an idle key loses nothing by eviction, since
// it would come back full anyway.
//
// A shard is an open-addressing table (linear probing) whose slots hold
// the key's bucket, its hash and, up to inlineKey bytes, the key itself,
// on one cache line: a draw for a key in the table reads the key's bytes
// (to hash them) and one slot, as a Go map lookup reads the key and its
// group; a map of pointers to buckets would cost a third cache miss.
// Longer keys are kept in a string beside the slot (one more miss).
// Lookups take no lock (keyShard.slots says why that is safe); writers
// (insert, evict, rehash) take the shard's mutex. A draw that races with
// its key's eviction, or with a rehash of its shard, lands on the evicted
// slot or on the old array, for that one draw: it is then admitted
// without being charged to the key's live bucket. Those races are rare
// (an eviction needs a full shard, a rehash happens once per n/8
// inserts) and cost at most one draw each, as a draw on a freed entry
// would in a map of pointers.
//
// An evicted key that still owes (its tat ahead of now: it drew beyond its
// burst's refill) leaves a tombstone: its fingerprint and its tat, in a
// small array of the shard indexed by another part of the hash. A key
// created while its tombstone is there starts with that tat, owing what
// it owed, so that a client cannot get a fresh burst by pushing its own
// key out of the table with others (Envoy's per-descriptor LRU has this
// hole). A tombstone that another eviction overwrites is lost: the key
// then starts full, as a key never seen does.
type table struct {
	seed   maphash.Seed
	long   maphash.Seed // the second half of a long key's digest
	shift  uint         // a key's shard is its hash >> shift
	shards [tableShards]keyShard
}

const (
	tableShards = 64
	// evictSample is how many keys an eviction looks at.
	evictSample = 8
	// inlineKey is the longest key a slot holds itself (an IPv4 address
	// in text is 15 bytes; a slot is then 64 bytes).
	inlineKey = 23
	// minSlots is a shard's first size: a table grows with its keys,
	// so that a limit configured with the default 100,000 keys costs
	// little until it has them.
	minSlots = 8
	// A slot's hash: empty, a key that was evicted (lookups go on past
	// it; a rehash drops it; an insert never takes it), or a key's hash
	// (>= firstHash).
	emptySlot = 0
	deadSlot  = 1
	firstHash = 2
	longKey   = 0xff // klen of a key kept in slot.long
)

type keyShard struct {
	// slots is read without a lock: a slot's key is written before its
	// hash is published, and never written again in that array; an
	// eviction marks the slot dead (the key stays until a rehash builds
	// a new array), and a new key takes an empty slot, never a dead one.
	// So a draw for a key in the table costs no atomic read-modify-write
	// before its bucket's own, and lookups on many processors share the
	// shard's lines read-only.
	slots atomic.Pointer[[]slot] // len a power of 2, at most 3/4 used or dead
	mu    sync.Mutex             // writers: insert, evict, rehash
	used  int                    // slots holding a key (under mu)
	dead  int                    // slots of evicted keys (under mu)
	max   int                    // keys at most
	tombs []tomb                 // under mu
	// The limit's counters for the keys of this shard.
	admitted atomic.Uint64
	failed   atomic.Uint64
	waited   atomic.Uint64
	evicted  uint64   // under mu
	_        [64]byte // the next shard's counters on another line
}

// slot is one key of a shard: 64 bytes, one cache line.
type slot struct {
	e    entry
	hash atomic.Uint64 // emptySlot, deadSlot, or the key's hash
	long string        // the key, if longer than inlineKey
	klen uint8         // the key's length, or longKey
	key  [inlineKey]byte
}

// is reports whether s holds key; the caller has matched its hash.
func (s *slot) is(key string) bool {
	if s.klen == longKey {
		return s.long == key
	}
	return int(s.klen) == len(key) && string(s.key[:s.klen]) == key
}

// set writes key into s, not yet published (the caller stores the hash).
func (s *slot) set(key string) {
	if len(key) > inlineKey {
		s.klen, s.long = longKey, strings.Clone(key)
		return
	}
	s.klen, s.long = uint8(len(key)), ""
	copy(s.key[:], key)
}

// entry is one key's bucket: its pool, and a cache of tokens leased from
// it in chunks (as a key-less bucket's shard: a draw within the cache
// reads no clock and swaps nothing), on its slot's cache line.
type entry struct {
	pool   pool
	tokens atomic.Int64
}

// takeFast draws one token from e's cache.
func (e *entry) takeFast() bool {
	if e.tokens.Add(-1) >= 0 {
		return true
	}
	e.tokens.Add(1)
	return false
}

// tomb remembers an evicted key that owed: until is its tat.
type tomb struct {
	fp    uint32
	until int64
}

func newTable(maxKeys int) *table {
	t := &table{seed: maphash.MakeSeed(), long: maphash.MakeSeed()}
	// As many shards as fit (at most tableShards, at least one key
	// each), so that the shards' parts add up to maxKeys.
	bits := uint(0)
	for bits < 6 && 2<<bits <= maxKeys {
		bits++
	}
	t.shift = 64 - bits
	n := 1 << bits
	for i := range n {
		s := &t.shards[i]
		s.max = maxKeys / n
		if i < maxKeys%n {
			s.max++
		}
		slots := make([]slot, minSlots)
		s.slots.Store(&slots)
		s.tombs = make([]tomb, max(s.max/4, 4))
	}
	return t
}

// maxKeyBytes bounds what a slot keeps of a key: a longer key (a header a
// client writes, up to the server's header limit) is kept as a 128-bit
// digest of it, under two seeds of the table, so that a table of MaxKeys
// keys never holds more than MaxKeys x maxKeyBytes of them. Digests are
// seeded per table: a client cannot make two long keys collide.
const maxKeyBytes = 128

// canon is key as the table keeps it: itself, or the digest of a long
// one (which allocates: only long keys pay for it).
func (t *table) canon(key string) string {
	if len(key) <= maxKeyBytes {
		return key
	}
	var d [17]byte
	d[0] = 0xff // a short key equal to a digest would have to guess both seeds
	binary.LittleEndian.PutUint64(d[1:], maphash.String(t.seed, key))
	binary.LittleEndian.PutUint64(d[9:], maphash.String(t.long, key))
	return string(d[:])
}

// shardOf is key's shard, and its hash.
func (t *table) shardOf(key string) (*keyShard, uint64) {
	h := maphash.String(t.seed, key)
	h = max(h, firstHash)
	return &t.shards[h>>t.shift], h
}

// lookup returns the entry of key (of hash h), or nil.
func (s *keyShard) lookup(key string, h uint64) *entry {
	slots := *s.slots.Load()
	mask := uint64(len(slots) - 1)
	for i := h & mask; ; i = (i + 1) & mask {
		sl := &slots[i]
		switch hv := sl.hash.Load(); {
		case hv == emptySlot:
			return nil
		case hv == h && sl.is(key):
			return &sl.e
		}
	}
}

// get returns key's entry, creating it at now if it is new (evicting one
// if the shard is full).
func (s *keyShard) get(key string, h uint64, now int64) *entry {
	if e := s.lookup(key, h); e != nil {
		return e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.lookup(key, h); e != nil {
		return e // created since
	}
	// The tombstone first: the eviction below may write over it.
	var tat int64
	tb := &s.tombs[h%uint64(len(s.tombs))]
	if tb.fp == uint32(h>>26) && tb.until > now {
		tat = tb.until // a returning key owes what it owed
		*tb = tomb{}
	}
	if s.used >= s.max {
		s.evict(now)
	}
	slots := *s.slots.Load()
	if (s.used+s.dead+1)*4 > len(slots)*3 {
		slots = s.rehash(slots)
	}
	mask := uint64(len(slots) - 1)
	i := h & mask
	for slots[i].hash.Load() != emptySlot {
		i = (i + 1) & mask
	}
	sl := &slots[i]
	sl.set(key)
	sl.e.pool.tat.Store(tat)
	sl.e.tokens.Store(0)
	sl.hash.Store(h) // published
	s.used++
	return &sl.e
}

// evict removes the fullest of a sample of keys. Callers hold mu.
func (s *keyShard) evict(now int64) {
	slots := *s.slots.Load()
	mask := len(slots) - 1
	var victim *slot
	seen := 0
	for i, start := 0, int(rand.Uint64()); i <= mask && seen < evictSample; i++ {
		sl := &slots[(start+i)&mask]
		if sl.hash.Load() < firstHash {
			continue
		}
		seen++
		if victim == nil || sl.e.pool.tat.Load() < victim.e.pool.tat.Load() {
			victim = sl
		}
	}
	if victim == nil {
		return
	}
	h := victim.hash.Load()
	if tat := victim.e.pool.tat.Load(); tat > now {
		// It owes: remember it.
		s.tombs[h%uint64(len(s.tombs))] = tomb{fp: uint32(h >> 26), until: tat}
	}
	victim.hash.Store(deadSlot)
	s.used--
	s.dead++
	s.evicted++
}

// rehash makes room for one more key in a new array, published when it
// is whole: twice the size if the keys need it, else the same size
// without the dead slots. Callers hold mu.
func (s *keyShard) rehash(old []slot) []slot {
	n := len(old)
	for (s.used+1)*8 > n*5 { // at most 5/8 used after it: room for n/8 inserts before the next
		n *= 2
	}
	slots := make([]slot, n)
	mask := uint64(n - 1)
	for i := range old {
		o := &old[i]
		h := o.hash.Load()
		if h < firstHash {
			continue
		}
		j := h & mask
		for slots[j].hash.Load() != emptySlot {
			j = (j + 1) & mask
		}
		sl := &slots[j]
		sl.long, sl.klen, sl.key = o.long, o.klen, o.key
		// Atomically: a draw may still hold o's entry.
		sl.e.pool.tat.Store(o.e.pool.tat.Load())
		sl.e.tokens.Store(o.e.tokens.Load())
		sl.hash.Store(h)
	}
	s.slots.Store(&slots)
	s.dead = 0
	return slots
}

// rebase carries every key over to a new config r: its cache goes back
// to its pool (a chunk of the old config may exceed the new burst), and
// its debt is clamped (pool.clampDebt). O(keys), once per config change.
func (t *table) rebase(r *rates, now int64) {
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		slots := *s.slots.Load()
		for j := range slots {
			if slots[j].hash.Load() >= firstHash {
				e := &slots[j].e
				if v := e.tokens.Load(); v > 0 && e.tokens.CompareAndSwap(v, 0) {
					e.pool.refund(r.cost(v))
				}
				e.pool.clampDebt(now, r.horizon)
			}
		}
		s.mu.Unlock()
	}
}

// counts sums the shards' counters, keys and evictions.
func (t *table) counts() (admitted, failed, waited, keys, evicted uint64) {
	for i := range t.shards {
		s := &t.shards[i]
		admitted += s.admitted.Load()
		failed += s.failed.Load()
		waited += s.waited.Load()
		s.mu.Lock()
		keys += uint64(s.used)
		evicted += s.evicted
		s.mu.Unlock()
	}
	return
}
