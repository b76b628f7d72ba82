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
// each with its kinds: action reject answers only packets to one of them.
// Addresses not in addrs are removed. IPv4-mapped IPv6 addresses are taken
// as IPv4.
func (d *Datapath) SetLocalAddresses(addrs map[netip.Addr]LocalKind) error {
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
	var errs []error
	for k, v := range want {
		if err := d.objs.RlLocal.Put(k, v); err != nil {
			errs = append(errs, fmt.Errorf("write local address: %w", err))
		}
	}
	var k bpf.RatelimitRlLocalKey
	var v uint32
	var stale []bpf.RatelimitRlLocalKey
	it := d.objs.RlLocal.Iterate()
	for it.Next(&k, &v) {
		if _, ok := want[k]; !ok {
			stale = append(stale, k)
		}
	}
	if err := it.Err(); err != nil {
		errs = append(errs, fmt.Errorf("list local addresses: %w", err))
	}
	for _, k := range stale {
		if err := d.objs.RlLocal.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("remove local address: %w", err))
		}
	}
	return errors.Join(errs...)
}

// SetInterfaceMACs makes macs (ifindex to MAC address) the interfaces'
// addresses that action reject checks a frame's destination against: only
// a frame to the receiving interface's own MAC is answered. Interfaces not
// in macs are removed.
func (d *Datapath) SetInterfaceMACs(macs map[uint32]net.HardwareAddr) error {
	var errs []error
	for idx, mac := range macs {
		if len(mac) != 6 {
			errs = append(errs, fmt.Errorf("interface %d: MAC address %v is not 6 bytes", idx, mac))
			continue
		}
		var v bpf.RatelimitRlMac
		copy(v.Addr[:], mac)
		if err := d.objs.RlIfMac.Put(idx, v); err != nil {
			errs = append(errs, fmt.Errorf("write interface %d's MAC address: %w", idx, err))
		}
	}
	var idx uint32
	var v bpf.RatelimitRlMac
	var stale []uint32
	it := d.objs.RlIfMac.Iterate()
	for it.Next(&idx, &v) {
		if _, ok := macs[idx]; !ok {
			stale = append(stale, idx)
		}
	}
	if err := it.Err(); err != nil {
		errs = append(errs, fmt.Errorf("list interface MAC addresses: %w", err))
	}
	for _, idx := range stale {
		if err := d.objs.RlIfMac.Delete(idx); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("remove interface %d's MAC address: %w", idx, err))
		}
	}
	return errors.Join(errs...)
}
