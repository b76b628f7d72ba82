package v1alpha1_test

import (
	"testing"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
)

// TestDataPathAgrees checks the values this package types a second time
// (it is a leaf and cannot import maps) against the data path's. Only the
// test imports maps.
func TestDataPathAgrees(t *testing.T) {
	if v1alpha1.MaxBurstSeconds != maps.MaxBurstSeconds {
		t.Errorf("MaxBurstSeconds %d, data path %d", v1alpha1.MaxBurstSeconds, maps.MaxBurstSeconds)
	}
	// The data path names its enums as the config file does.
	for _, c := range []struct{ api, dp string }{
		{string(v1alpha1.UnitPackets), maps.Packets.String()},
		{string(v1alpha1.UnitBytes), maps.Bytes.String()},
		{string(v1alpha1.ActionDrop), maps.Drop.String()},
		{string(v1alpha1.ActionShadow), maps.Shadow.String()},
		{string(v1alpha1.KeyNone), maps.KeyNone.String()},
		{string(v1alpha1.KeySrcIP), maps.KeySrcIP.String()},
		{string(v1alpha1.KeyDstIP), maps.KeyDstIP.String()},
		{string(v1alpha1.KeySrcPrefix), maps.KeySrcPrefix.String()},
		{string(v1alpha1.KeyDstPort), maps.KeyDstPort.String()},
	} {
		if c.api != c.dp {
			t.Errorf("config name %q, data path name %q", c.api, c.dp)
		}
	}
}
