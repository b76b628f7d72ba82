package vmtests

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// aptCacheSearch is `apt-cache search --names-only '^linux-image-6'` on
// bookworm (trimmed), in apt's order, which is not version order: a string
// sort would put 6.1.0-9 above 6.1.0-57 and 6.12.99 above 6.12.117.
const aptCacheSearch = `linux-image-6.1.0-57-cloud-amd64-unsigned - Linux 6.1 for x86-64 cloud
linux-image-6.1.0-9-cloud-amd64-unsigned - Linux 6.1 for x86-64 cloud
linux-image-6.1.0-57-amd64-unsigned - Linux 6.1 for 64-bit PCs
linux-image-6.1.0-57-cloud-amd64 - Linux 6.1 for x86-64 cloud (signed)
linux-image-6.1.0-57-cloud-amd64-dbg - Debug symbols for linux-image-6.1.0-57-cloud-amd64
linux-image-6.1.0-56-cloud-amd64-unsigned - Linux 6.1 for x86-64 cloud
linux-image-6.1.0-57-rt-amd64-unsigned - Linux 6.1 for 64-bit PCs, PREEMPT_RT
linux-image-6.12.99+deb12-cloud-amd64-unsigned - Linux 6.12 for x86-64 cloud
linux-image-6.12.117+deb12-cloud-amd64-unsigned - Linux 6.12 for x86-64 cloud
linux-image-6.12.117+deb12-amd64-unsigned - Linux 6.12 for 64-bit PCs
linux-image-6.12.117+deb12-rt-amd64-unsigned - Linux 6.12 for 64-bit PCs, PREEMPT_RT
linux-image-6.12.113+deb12-cloud-amd64-unsigned - Linux 6.12 for x86-64 cloud
linux-image-6.12.117+deb12-cloud-amd64-dbg - Debug symbols for linux-image-6.12.117+deb12-cloud-amd64
linux-image-cloud-amd64 - Linux for x86-64 cloud (meta-package)
linux-image-5.10.0-35-cloud-amd64-unsigned - Linux 5.10 for x86-64 cloud
linux-image-6.10.11+bpo-cloud-amd64-unsigned - Linux 6.10 for x86-64 cloud
`

func TestImagePackages(t *testing.T) {
	lines := strings.Split(aptCacheSearch, "\n")
	for _, tc := range []struct {
		series, flavor string
		want           []string // releases, newest first
	}{
		{"6.1", "cloud-amd64", []string{"6.1.0-57-cloud-amd64", "6.1.0-56-cloud-amd64", "6.1.0-9-cloud-amd64"}},
		{"6.1", "amd64", []string{"6.1.0-57-amd64"}},
		{"6.12", "cloud-amd64", []string{"6.12.117+deb12-cloud-amd64", "6.12.113+deb12-cloud-amd64", "6.12.99+deb12-cloud-amd64"}},
		{"6.12", "amd64", []string{"6.12.117+deb12-amd64"}},
		{"6.12", "rt-amd64", []string{"6.12.117+deb12-rt-amd64"}},
		{"5.10", "cloud-amd64", []string{"5.10.0-35-cloud-amd64"}},
		{"6.10", "cloud-amd64", []string{"6.10.11+bpo-cloud-amd64"}},
		{"6", "cloud-amd64", []string{"6.12.117+deb12-cloud-amd64", "6.12.113+deb12-cloud-amd64", "6.12.99+deb12-cloud-amd64",
			"6.10.11+bpo-cloud-amd64", "6.1.0-57-cloud-amd64", "6.1.0-56-cloud-amd64", "6.1.0-9-cloud-amd64"}},
		{"6.6", "cloud-amd64", nil},
	} {
		var got []string
		for _, p := range ImagePackages(lines, tc.series, tc.flavor) {
			if p.Name != "linux-image-"+p.Release+"-unsigned" {
				t.Errorf("package %s has release %s", p.Name, p.Release)
			}
			got = append(got, p.Release)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("series %s flavor %s: got %q, want %q", tc.series, tc.flavor, got, tc.want)
		}
	}
}

func TestSeries(t *testing.T) {
	if got, want := Series(), []string{"5.10", "6.1", "6.12"}; !slices.Equal(got, want) {
		t.Errorf("Series() = %q, want %q", got, want)
	}
	for s, suite := range seriesSuite {
		if _, ok := debianSuites[suite]; !ok {
			t.Errorf("series %s: Debian %s has no sources", s, suite)
		}
	}
}

func TestModuleLoadOrder(t *testing.T) {
	index := map[string]string{
		"veth":       "kernel/drivers/net/veth.ko.xz",
		"macvlan":    "kernel/drivers/net/macvlan.ko",
		"macvtap":    "kernel/drivers/net/macvtap.ko",
		"tap":        "kernel/drivers/net/tap.ko",
		"nf_tables":  "kernel/net/netfilter/nf_tables.ko",
		"needs_gone": "kernel/x/needs-gone.ko",
	}
	deps := map[string][]string{
		"kernel/drivers/net/macvtap.ko":     {"macvlan", "tap"},
		"kernel/drivers/net/tap.ko":         {"macvlan"}, // made up: a shared dependency
		"kernel/net/netfilter/nf_tables.ko": {"nfnetlink"},
		"kernel/x/needs-gone.ko":            {"gone"},
	}
	builtin := map[string]bool{"nfnetlink": true}
	depends := func(file string) ([]string, error) { return deps[file], nil }
	for _, tc := range []struct {
		names   []string
		want    []string
		wantErr string
	}{
		{names: []string{"veth"}, want: []string{"kernel/drivers/net/veth.ko.xz"}},
		{names: []string{"macvtap", "veth"}, want: []string{"kernel/drivers/net/macvlan.ko", "kernel/drivers/net/tap.ko", "kernel/drivers/net/macvtap.ko", "kernel/drivers/net/veth.ko.xz"}},
		{names: []string{"nf-tables"}, want: []string{"kernel/net/netfilter/nf_tables.ko"}},
		{names: []string{"nfnetlink"}, want: nil},
		{names: []string{"nope"}, wantErr: "module nope: no file and not built in"},
		{names: []string{"needs_gone"}, wantErr: "module gone (needed by needs_gone): no file and not built in"},
	} {
		got, err := ModuleLoadOrder(tc.names, index, builtin, depends)
		if tc.wantErr != "" {
			if err == nil || err.Error() != tc.wantErr {
				t.Errorf("%q: error %v, want %q", tc.names, err, tc.wantErr)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("%q: got %q, %v; want %q", tc.names, got, err, tc.want)
		}
	}
	boom := errors.New("boom")
	if _, err := ModuleLoadOrder([]string{"veth"}, index, nil, func(string) ([]string, error) { return nil, boom }); !errors.Is(err, boom) {
		t.Errorf("a failing depends: error %v, want boom", err)
	}
}

func TestModinfo(t *testing.T) {
	info := []byte("alias=rtnl-link-veth\x00license=GPL v2\x00depends=\x00retpoline=Y\x00intree=Y\x00name=veth\x00")
	if d := ModinfoDepends(info); d != nil {
		t.Errorf("veth depends on %q, want nothing", d)
	}
	info = []byte("license=GPL\x00depends=macvlan,tap\x00name=macvtap\x00")
	if d := ModinfoDepends(info); !slices.Equal(d, []string{"macvlan", "tap"}) {
		t.Errorf("macvtap depends on %q, want macvlan, tap", d)
	}
	for path, want := range map[string]string{
		"kernel/drivers/net/veth.ko":      "veth",
		"kernel/drivers/net/veth.ko.xz":   "veth",
		"kernel/net/nf-tables.ko.zst":     "nf_tables",
		"/lib/modules/x/kernel/a-b.ko.gz": "a_b",
	} {
		if got := ModuleName(path); got != want {
			t.Errorf("ModuleName(%s) = %s, want %s", path, got, want)
		}
	}
}
