package agent

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

// Each enum has its words in api/v1alpha1 (the values validation accepts),
// its values in maps (named by their String, from the C enums), and one
// table between them here. A value one layer has and another lacks fails
// here: a key kind added to the data path and the config but not to the
// table, or one the table maps to a value the data path does not name.
func TestEnumTables(t *testing.T) {
	// unit requests and key custom are the limiter library's: no node
	// installs such a limit (nodeSpec), so they have no data path value.
	enumTable(t, "unit", without(v1alpha1.Units, v1alpha1.UnitRequests), units)
	enumTable(t, "action", v1alpha1.Actions, actions)
	enumTable(t, "key", without(v1alpha1.Keys, v1alpha1.KeyCustom), keys)
	enumTable(t, "attach", v1alpha1.Attaches, attaches)
	enumTable(t, "direction", v1alpha1.Directions, directions)
	enumTable(t, "protocol", v1alpha1.Protocols, protocols)
}

// without is valid less the words in-process limits alone use.
func without[K comparable](valid []K, inProcess K) []K {
	return slices.DeleteFunc(slices.Clone(valid), func(k K) bool { return k == inProcess })
}

func enumTable[K ~string, V interface {
	~uint8
	fmt.Stringer
}](t *testing.T, kind string, valid []K, table map[K]V) {
	t.Helper()
	if len(table) != len(valid) {
		t.Errorf("%s: the table has %d words, the config accepts %d (%v)", kind, len(table), len(valid), valid)
	}
	mapped := make(map[string]bool)
	for _, k := range valid {
		v, ok := table[k]
		if !ok {
			t.Errorf("%s %q: the config accepts it, the table has no data path value for it", kind, k)
			continue
		}
		if v.String() != string(k) {
			t.Errorf("%s %q: the data path's value %d is named %q", kind, k, uint8(v), v.String())
		}
		mapped[v.String()] = true
	}
	for x := range 256 {
		name := V(x).String()
		if !strings.HasPrefix(name, kind+"(") && !mapped[name] {
			t.Errorf("%s %d: the data path names it %q, and no config word maps to it", kind, x, name)
		}
	}
}
