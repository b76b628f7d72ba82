package maps

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/bpf"
)

// LocalKind says what an address of the node's is to it: flags.
type LocalKind uint32

const (
	// LocalNode is one of the node's own addresses.
	LocalNode = LocalKind(bpf.RatelimitRlLocalFlagRL_LOCAL_NODE)
	// LocalEndpoint is a local endpoint's address, which the node delivers.
	LocalEndpoint = LocalKind(bpf.RatelimitRlLocalFlagRL_LOCAL_ENDPOINT)
)

// MaxLocalAddresses is the most addresses SetLocalAddresses takes.
const MaxLocalAddresses = int(bpf.RatelimitRlConstRL_MAX_LOCAL)

// localKey is the data path's key of addr: IPv4 in the last word, as its
// parser keeps it.
func localKey(addr netip.Addr) bpf.RatelimitRlLocalKey {
	var k bpf.RatelimitRlLocalKey
	if addr.Is4() {
		k.Family = 4
		a := addr.As4()
		k.A[3] = binary.NativeEndian.Uint32(a[:])
		return k
	}
	k.Family = 6
	a := addr.As16()
	for i := range 4 {
		k.A[i] = binary.NativeEndian.Uint32(a[4*i:])
	}
	return k
}

// SetLocalAddresses makes addrs the addresses the node owns or delivers,
// each with its kinds: action reject answers only packets to one of them,
// and protect rules exempt only packets to or from a node address.
// Addresses not in addrs are removed. IPv4-mapped IPv6 addresses are taken
// as IPv4.
func (d *Datapath) SetLocalAddresses(addrs map[netip.Addr]LocalKind) error {
	return d.writeLocal(addrs, true)
}

// AddLocalAddresses writes addrs as SetLocalAddresses does but removes
// none: for a list that may be incomplete (a netlink dump that was
// interrupted), where removing what it lacks could take a node address out
// of the protect rules' reach until the next complete list.
func (d *Datapath) AddLocalAddresses(addrs map[netip.Addr]LocalKind) error {
	return d.writeLocal(addrs, false)
}

func (d *Datapath) writeLocal(addrs map[netip.Addr]LocalKind, prune bool) error {
	if len(addrs) > MaxLocalAddresses {
		return fmt.Errorf("local addresses: %d are more than %d", len(addrs), MaxLocalAddresses)
	}
	want := make(map[bpf.RatelimitRlLocalKey]uint32, len(addrs))
	for a, kind := range addrs {
		if !a.IsValid() || kind == 0 {
			continue
		}
		k := localKey(a.Unmap())
		want[k] |= uint32(kind)
	}
	if err := syncMap(d.objs.RlLocal, want, prune); err != nil {
		return fmt.Errorf("local addresses: %w", err)
	}
	return nil
}

// SetInterfaceMACs makes macs (ifindex to MAC address) the interfaces'
// addresses that action reject checks a frame's destination against: only
// a frame to the receiving interface's own MAC is answered. Interfaces not
// in macs are removed.
func (d *Datapath) SetInterfaceMACs(macs map[uint32]net.HardwareAddr) error {
	var errs []error
	want := make(map[uint32]bpf.RatelimitRlMac, len(macs))
	for idx, mac := range macs {
		if len(mac) != 6 {
			errs = append(errs, fmt.Errorf("interface %d: MAC address %v is not 6 bytes", idx, mac))
			continue
		}
		var v bpf.RatelimitRlMac
		copy(v.Addr[:], mac)
		want[idx] = v
	}
	if err := syncMap(d.objs.RlIfMac, want, true); err != nil {
		errs = append(errs, fmt.Errorf("interface MAC addresses: %w", err))
	}
	return errors.Join(errs...)
}

// syncMap makes m hold want: it writes the entries that are missing or
// hold another value (the agent calls this on every reconcile, and most
// find nothing to write), and with prune deletes those want lacks. It goes
// on past a failed entry and returns every error.
func syncMap[K, V comparable](m *ebpf.Map, want map[K]V, prune bool) error {
	var (
		errs  []error
		k     K
		v     V
		have  = make(map[K]V)
		stale []K
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		have[k] = v
		if _, ok := want[k]; !ok && prune {
			stale = append(stale, k)
		}
	}
	if err := it.Err(); err != nil {
		errs = append(errs, fmt.Errorf("list: %w", err))
	}
	for k, v := range want {
		if cur, ok := have[k]; ok && cur == v {
			continue
		}
		if err := m.Put(k, v); err != nil {
			errs = append(errs, fmt.Errorf("write %v: %w", k, err))
		}
	}
	for _, k := range stale {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("remove %v: %w", k, err))
		}
	}
	return errors.Join(errs...)
}
