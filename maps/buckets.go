package maps

import (
	"errors"
	"fmt"
	"math/bits"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/bpf"
)

// The keyed buckets' table.
//
// rl_buckets is an array of sets of bpf.RatelimitRlConstRL_BUCKET_WAYS ways;
// a keyed bucket's set and its tag there come from the keyed hash of its
// limit, generation and key (bucketHash, bucketPlace: the data path's
// rl_hash and rl_bucket_place, in Go). rl_bucket_keys holds each way's key
// for user space, written by the data path after it took the way: a way
// whose key does not hash to its tag is being taken, and is skipped.
//
// The agent changes a way (a deleted limit's buckets, a key's pool moved
// to its limit's clock) with the data path's own compare-and-swap, on the
// table mapped into its memory: a whole-value write would undo what a CPU
// did to the set's other ways meanwhile.

const bucketWays = int(bpf.RatelimitRlConstRL_BUCKET_WAYS)

// bucketSets is the number of sets of the table for maxBuckets live
// buckets: twice maxBuckets ways, rounded up to a power of two, in sets
// of bucketWays. At half its ways live (maxBuckets) a set of four
// overflows for ~3.7% of the keys, at a quarter (maxBuckets / 2) for
// ~0.4% (Poisson, TestBucketDisplacement); the memory is that of the LRU
// hash it replaced (80 bytes a bucket of maxBuckets: 2 ways of 16 bytes,
// 2 keys of 24).
func bucketSets(maxBuckets uint32) uint32 {
	return max(uint32(2)<<bits.Len32(max(maxBuckets, 1)-1)/uint32(bucketWays), 1)
}

// bucketHash is rl_hash (keycache.h): the keyed hash of limit id's bucket
// of generation gen for the key's words addr.
func bucketHash(seed [2]uint64, id, gen uint32, addr [4]uint32) uint64 {
	hi := uint64(addr[0])<<32 | uint64(addr[1])
	lo := uint64(addr[2])<<32 | uint64(addr[3])
	lg := uint64(id)<<32 | uint64(gen)
	h := hi*(seed[0]|1) + lo*(seed[1]|1) + lg*((seed[0]^seed[1])|1) + seed[0]>>1
	h ^= h >> 32
	h *= 0xd6e8feb86659fd93
	return h ^ h>>32
}

// bucketPlace is rl_bucket_place (keycache.h): the set of the bucket of
// hash h in a table of mask+1 sets, and its tag there.
func bucketPlace(h uint64, id, gen, mask uint32) (set uint32, tag uint64) {
	h ^= h >> 31
	h *= 0x94d049bb133111eb
	h ^= h >> 29
	tag = h&^0xffff | 1<<63 | uint64(gen&0xff)<<8 | uint64(id&0xff)
	return uint32(h) & mask, tag
}

// placeOf is where the bucket of key k sits in d's table.
func (d *Datapath) placeOf(k *bpf.RatelimitRlBucketKey) (set uint32, tag uint64) {
	return bucketPlace(bucketHash(d.state.cfg.Seed, k.Limit, k.Gen, k.Addr), k.Limit, k.Gen, d.objs.RlBuckets.MaxEntries()-1)
}

// eachBucket calls each for every way of the table that holds a bucket,
// with its key and pool, in batches of sets.
func (d *Datapath) eachBucket(each func(set uint32, way int, k *bpf.RatelimitRlBucketKey, vEmpty uint64)) error {
	if d.objs.RlBuckets == nil || d.objs.RlBucketKeys == nil {
		return errors.New("the pinned maps have no bucket table (pinned by an earlier version of rlagent)")
	}
	const batch = 1024
	var (
		sets   = make([]bpf.RatelimitRlBucketSet, batch)
		keys   = make([]bpf.RatelimitRlBucketKeyset, batch)
		idx    = make([]uint32, batch)
		kidx   = make([]uint32, batch)
		cursor ebpf.MapBatchCursor
		kc     ebpf.MapBatchCursor
		mask   = d.objs.RlBuckets.MaxEntries() - 1
	)
	for {
		n, err := d.objs.RlBuckets.BatchLookup(&cursor, idx, sets, nil)
		if n > 0 {
			// The keys of the same sets: written after their ways, so
			// read after them.
			if _, kerr := d.objs.RlBucketKeys.BatchLookup(&kc, kidx[:n], keys[:n], nil); kerr != nil && !errors.Is(kerr, ebpf.ErrKeyNotExist) {
				return fmt.Errorf("read bucket keys: %w", kerr)
			}
		}
		for i := range n {
			for w := range bucketWays {
				tag := sets[i].Way[w].Tag
				if tag == 0 {
					continue
				}
				k := &keys[i].Key[w]
				if s, t := bucketPlace(bucketHash(d.state.cfg.Seed, k.Limit, k.Gen, k.Addr), k.Limit, k.Gen, mask); s != idx[i] || t != tag {
					continue // being taken by a new key
				}
				each(idx[i], w, k, sets[i].Way[w].Pool.V_empty)
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read buckets: %w", err)
		}
	}
}

// bucketTable is the table mapped into the agent's memory, for
// compare-and-swap: its sets as the data path lays them out.
func (d *Datapath) bucketTable() ([]bpf.RatelimitRlBucketSet, error) {
	if d.buckets != nil {
		return d.buckets, nil
	}
	m := d.objs.RlBuckets
	size := int(m.MaxEntries()) * int(unsafe.Sizeof(bpf.RatelimitRlBucketSet{}))
	page := unix.Getpagesize()
	mem, err := unix.Mmap(m.FD(), 0, (size+page-1)/page*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map the bucket table: %w", err)
	}
	d.bucketMem = mem
	d.buckets = unsafe.Slice((*bpf.RatelimitRlBucketSet)(unsafe.Pointer(&mem[0])), m.MaxEntries())
	return d.buckets, nil
}

// wayOf is the way of the mapped table that holds key k, and k's tag; a
// nil way when the table does not hold k.
func (d *Datapath) wayOf(k *bpf.RatelimitRlBucketKey) (*bpf.RatelimitRlBucketWay, uint64, error) {
	table, err := d.bucketTable()
	if err != nil {
		return nil, 0, err
	}
	set, tag := d.placeOf(k)
	for w := range bucketWays {
		if way := &table[set].Way[w]; atomic.LoadUint64(&way.Tag) == tag {
			return way, tag, nil
		}
	}
	return nil, 0, nil
}

// clearBucket empties key k's way, if the table holds k: its tag from k's
// to 0, unless a new key took the way meanwhile.
func (d *Datapath) clearBucket(k *bpf.RatelimitRlBucketKey) error {
	way, tag, err := d.wayOf(k)
	if way != nil {
		atomic.CompareAndSwapUint64(&way.Tag, tag, 0)
	}
	return err
}

// moveBucket sets the pool of key k's bucket, if the table holds it, to
// to(its v_empty), with a compare-and-swap tried again while CPUs lease
// from it meanwhile (a few times: a lease is a millisecond of the rate).
func (d *Datapath) moveBucket(k *bpf.RatelimitRlBucketKey, to func(vEmpty uint64) uint64) error {
	way, _, err := d.wayOf(k)
	if way == nil {
		return err // evicted, or the table could not be mapped
	}
	for range 8 {
		old := atomic.LoadUint64(&way.Pool.V_empty)
		if atomic.CompareAndSwapUint64(&way.Pool.V_empty, old, to(old)) {
			return nil
		}
	}
	return nil
}

// unmapBuckets releases the table's mapping.
func (d *Datapath) unmapBuckets() error {
	if d.bucketMem == nil {
		return nil
	}
	err := unix.Munmap(d.bucketMem)
	d.bucketMem, d.buckets = nil, nil
	return err
}
