// Package bpftest holds what rlagent's tests need of BPF besides rlagent's
// own programs: small foreign programs, written with cilium/ebpf's asm, to
// put next to ours (a counter that passes packets on, a program that hands
// packets to a pod with bpf_redirect_peer, as Cilium does), ways to attach
// them as another tool would, and reads of what runs at an interface's
// hooks in a test's network namespace.
//
// Every helper fails the test on error and undoes what it did in the
// test's Cleanup.
package bpftest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"
)

// Verdicts of the test programs.
const (
	// TCXNext lets the next program run (TCX_NEXT; TC_ACT_UNSPEC for a
	// clsact filter).
	TCXNext = -1
	// TCXDrop drops the packet (TCX_DROP, TC_ACT_SHOT).
	TCXDrop = 2
	// XDPPass passes the frame on to the stack.
	XDPPass = 2
)

// Offsets the programs read.
const (
	xdpData     = 0  // xdp_md.data
	xdpDataEnd  = 4  // xdp_md.data_end
	skbProtocol = 16 // __sk_buff.protocol
	skbData     = 76 // __sk_buff.data
	skbDataEnd  = 80 // __sk_buff.data_end
	ethProto    = 12 // ethhdr.h_proto
	ethLen      = 14
	ipv4Daddr   = 16 // iphdr.daddr
	ipv6Daddr   = 24 // ipv6hdr.daddr
	ipv6HdrLen  = 40
	ethPIPLE    = 0x0008 // ETH_P_IP in network order, read little-endian
	ethPIPv6LE  = 0xdd86 // ETH_P_IPV6 in network order, read little-endian
)

// Counter is a foreign program that counts the IPv4 packets it sees into a
// one-slot array and returns a fixed verdict. Counting only IPv4 keeps the
// namespaces' IPv6 chatter (router and multicast listener messages) and ARP
// out of the exact counts tests compare.
type Counter struct {
	Prog *ebpf.Program
	// m is the count: an array of one u64, added to atomically (a program
	// runs on several CPUs at once).
	m *ebpf.Map
}

// NewCounter loads a Counter of type typ (ebpf.XDP or ebpf.SchedCLS) named
// name, as the kernel shows it, that returns verdict.
func NewCounter(tb testing.TB, typ ebpf.ProgramType, name string, verdict int32) *Counter {
	tb.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		tb.Fatalf("counter map: %v", err)
	}
	tb.Cleanup(func() { m.Close() })
	insns := asm.Instructions{asm.Mov.Reg(asm.R6, asm.R1)}
	if typ == ebpf.XDP {
		// The Ethernet header must be in the frame before its type is read
		// (direct packet access: the verifier wants the check).
		insns = append(insns,
			asm.LoadMem(asm.R2, asm.R6, xdpData, asm.Word),
			asm.LoadMem(asm.R3, asm.R6, xdpDataEnd, asm.Word),
			asm.Mov.Reg(asm.R4, asm.R2),
			asm.Add.Imm(asm.R4, ethLen),
			asm.JGT.Reg(asm.R4, asm.R3, "out"),
			asm.LoadMem(asm.R2, asm.R2, ethProto, asm.Half),
		)
	} else {
		insns = append(insns, asm.LoadMem(asm.R2, asm.R6, skbProtocol, asm.Word))
	}
	insns = append(insns,
		asm.JNE.Imm(asm.R2, ethPIPLE, "out"),
		asm.StoreImm(asm.RFP, -4, 0, asm.Word),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.LoadMapPtr(asm.R1, m.FD()),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.Mov.Imm(asm.R1, 1),
		asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R0, verdict).WithSymbol("out"),
		asm.Return(),
	)
	return &Counter{Prog: Load(tb, typ, name, insns), m: m}
}

// N is how many IPv4 packets the program has seen.
func (c *Counter) N(tb testing.TB) uint64 {
	tb.Helper()
	var v uint64
	if err := c.m.Lookup(uint32(0), &v); err != nil {
		tb.Fatalf("read the counter: %v", err)
	}
	return v
}

// ID is the program's ID.
func (c *Counter) ID(tb testing.TB) ebpf.ProgramID { return ProgramID(tb, c.Prog) }

// Wait waits up to a second for the count to reach want (the program
// counts on other CPUs, microseconds later) and returns it.
func (c *Counter) Wait(tb testing.TB, want uint64) uint64 {
	tb.Helper()
	deadline := time.Now().Add(time.Second)
	for {
		got := c.N(tb)
		if got >= want || time.Now().After(deadline) {
			return got
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ProgramID is prog's ID.
func ProgramID(tb testing.TB, prog *ebpf.Program) ebpf.ProgramID {
	tb.Helper()
	info, err := prog.Info()
	if err != nil {
		tb.Fatal(err)
	}
	id, ok := info.ID()
	if !ok {
		tb.Fatal("the kernel gives no program ID")
	}
	return id
}

// Load loads a program the test wrote.
func Load(tb testing.TB, typ ebpf.ProgramType, name string, insns asm.Instructions) *ebpf.Program {
	tb.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: name, Type: typ, Instructions: insns, License: "GPL"})
	if err != nil {
		tb.Fatalf("load %s: %+v", name, err)
	}
	tb.Cleanup(func() { prog.Close() })
	return prog
}

// LiveFramesRefused returns the kernel's refusal of BPF_PROG_TEST_RUN with
// BPF_F_TEST_XDP_LIVE_FRAMES to any program (EPERM for one frame of an
// XDP_DROP of two instructions, in no namespace of the test's), or nil when
// the kernel allows it or fails it otherwise: what the test itself then
// meets is its own failure. Some sandboxes refuse live frames to root with
// CAP_BPF and CAP_NET_ADMIN.
func LiveFramesRefused(tb testing.TB) error {
	tb.Helper()
	prog := Load(tb, ebpf.XDP, "live_probe", asm.Instructions{
		asm.Mov.Imm(asm.R0, 1), // XDP_DROP
		asm.Return(),
	})
	_, err := prog.Run(&ebpf.RunOptions{Data: make([]byte, 60), Repeat: 1, Flags: unix.BPF_F_TEST_XDP_LIVE_FRAMES})
	if errors.Is(err, unix.EPERM) {
		return err
	}
	return nil
}

// RedirectPeer is a TC program that hands packets to the peer of the veth
// ifindex (the pod's own interface, in its namespace) with
// bpf_redirect_peer, as Cilium's BPF host routing delivers into a pod: the
// packet enters the pod without passing the node's routing or the host
// side's egress hook. With no addresses it hands over every packet; with
// some, only IPv4 and IPv6 packets to one of them, and every other packet
// goes on (TCX_NEXT).
func RedirectPeer(tb testing.TB, ifindex int, only ...netip.Addr) *ebpf.Program {
	tb.Helper()
	redirect := asm.Instructions{
		asm.Mov.Imm(asm.R1, int32(ifindex)).WithSymbol("redirect"),
		asm.Mov.Imm(asm.R2, 0),
		asm.FnRedirectPeer.Call(),
		asm.Return(),
	}
	if len(only) == 0 {
		return Load(tb, ebpf.SchedCLS, "test_redir_peer", redirect)
	}
	// Four bytes of the packet loaded as a u32 on this little-endian
	// machine.
	word := func(b []byte) int32 { return int32(binary.LittleEndian.Uint32(b)) }
	insns := asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, skbData, asm.Word), // the Ethernet header, at TC
		asm.LoadMem(asm.R3, asm.R1, skbDataEnd, asm.Word),
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, ethLen+ipv6HdrLen), // up to an IPv6 destination; an IPv4 one ends before
		asm.JGT.Reg(asm.R4, asm.R3, "next"),
		asm.LoadMem(asm.R6, asm.R2, ethProto, asm.Half),
	}
	// One block an address, each starting at label "addr<i>"; a miss goes
	// on to the next block, the last one's to "next".
	label := func(i int) string {
		if i == len(only) {
			return "next"
		}
		return fmt.Sprintf("addr%d", i)
	}
	for i, a := range only {
		miss := label(i + 1)
		var block asm.Instructions
		if a.Is4() {
			b := a.As4()
			block = asm.Instructions{
				asm.JNE.Imm(asm.R6, ethPIPLE, miss),
				asm.LoadMem(asm.R5, asm.R2, ethLen+ipv4Daddr, asm.Word),
				asm.JNE.Imm32(asm.R5, word(b[:]), miss),
			}
		} else {
			b := a.As16()
			block = asm.Instructions{asm.JNE.Imm(asm.R6, ethPIPv6LE, miss)}
			for j := range 4 {
				block = append(block,
					asm.LoadMem(asm.R5, asm.R2, int16(ethLen+ipv6Daddr+4*j), asm.Word),
					asm.JNE.Imm32(asm.R5, word(b[4*j:4*j+4]), miss))
			}
		}
		block[0] = block[0].WithSymbol(label(i))
		insns = append(insns, block...)
		insns = append(insns, asm.Ja.Label("redirect"))
	}
	insns = append(insns, asm.Mov.Imm(asm.R0, TCXNext).WithSymbol("next"), asm.Return())
	insns = append(insns, redirect...)
	return Load(tb, ebpf.SchedCLS, "test_redir_peer", insns)
}
