package bpf_test

import "testing"

func TestSmoke(t *testing.T) {
	d := testDatapath(t)
	mustSet(t, d, 0, perSecond(1000, 10))
	p := udp4("10.0.0.1", "10.0.0.2", 53)
	var pass int
	for i := 0; i < 20; i++ {
		if mustRun(t, d.Program(), p) == xdpPass {
			pass++
		}
	}
	t.Log(pass, mustStats(t, d, 0))
	if pass != 10 {
		t.Fatalf("admitted %d of 20 with burst 10 and no time passing, want 10", pass)
	}
}
