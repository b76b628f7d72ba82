package v1alpha1

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"time"

	yamlv2 "go.yaml.in/yaml/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rlagent/rlagent/internal/regularfile"
)

// MaxConfigBytes bounds a config file: far above the largest valid one
// (128 limits with 256 networks on each side), far below what would strain
// the agent's memory.
const MaxConfigBytes = 16 << 20

// ReadConfigFile reads the config file at path as it is: a regular file of
// at most MaxConfigBytes, read without blocking on a FIFO and without
// reading a device or a longer file to its end (regularfile.Read).
func ReadConfigFile(path string) ([]byte, error) {
	data, err := regularfile.Read(path, MaxConfigBytes)
	switch {
	case errors.Is(err, regularfile.ErrNotRegular), errors.Is(err, regularfile.ErrTooLarge):
		return nil, fmt.Errorf("read config %s: %w", path, err)
	case err != nil:
		return nil, fmt.Errorf("read config: %w", err)
	}
	return data, nil
}

// LoadConfig reads the config file at path (ReadConfigFile) with
// ParseConfig.
func LoadConfig(path string) (*Config, error) {
	data, err := ReadConfigFile(path)
	if err != nil {
		return nil, fmt.Errorf("load config: %w", err)
	}
	c, err := ParseConfig(data)
	if err != nil {
		return nil, wrap("load config "+path, err)
	}
	return c, nil
}

// ParseConfig reads a config file's contents strictly (see DecodeConfig),
// applies the defaults and validates the result. It returns either a config
// the agent can run or every problem found.
func ParseConfig(data []byte) (*Config, error) {
	c, err := DecodeConfig(data)
	if err != nil {
		return nil, err
	}
	c.Default()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// DecodeConfig reads a config file's contents strictly and nothing more: no
// defaults, no validation. It is the config as written, for a tool that edits
// the file (rlagent limits set) without writing every default into it.
//
// Strictly means: a YAML syntax error or a duplicate key is an error, and so
// is an unknown field (field names are case-sensitive) and a value of the
// wrong kind, each a *FieldError naming the field by its path. A number where
// a string belongs is taken as its text (dstPorts: [53]); a bare yes, no, on
// or off is an error there, because YAML reads it as a boolean: quote it
// ("off").
func DecodeConfig(data []byte) (*Config, error) {
	return decodeStrict[Config](data, "config", "interfaces:, limits:, ...")
}

// decodeStrict is DecodeConfig for a file of type T, called what, whose
// fields are (for the message of a file that is not a mapping) fields.
func decodeStrict[T any](data []byte, what, fields string) (*T, error) {
	// Syntax and duplicate keys. The error says "yaml: line N: ...".
	var strict any
	if err := yamlv2.UnmarshalStrict(data, &strict); err != nil {
		return nil, err
	}
	// The same document with its mappings in order, so that the problems are
	// reported in the order of the file.
	var tree yamlv2.MapSlice
	if err := yamlv2.Unmarshal(data, &tree); err != nil {
		return nil, &FieldError{Field: what, Detail: "expected a mapping of fields (" + fields + ")"}
	}
	// Check the shape against the types and convert the tree to JSON values.
	// This does what sigs.k8s.io/yaml does, with the field's full path in
	// every error; sigs.k8s.io/yaml (v1.6.0) also matches field names
	// case-insensitively, and does not turn a number into a string below an
	// inline struct (Limit embeds RateLimitSpec), so dstPorts: [53] would fail.
	j, el := toJSON(tree, reflect.TypeFor[T](), "")
	if len(el) > 0 {
		return nil, errors.Join(el...)
	}
	buf, err := json.Marshal(j)
	if err != nil {
		return nil, fmt.Errorf("decode %s: %w", what, err)
	}
	d := json.NewDecoder(bytes.NewReader(buf))
	d.DisallowUnknownFields()
	var c T
	if err := d.Decode(&c); err != nil {
		// toJSON has checked every field and kind; this is a bug.
		return nil, fmt.Errorf("decode %s: %w", what, err)
	}
	return &c, nil
}

// LimitsFile is the limiter library's file (package limiter's
// FromFile): the limits a service's own processes enforce per request,
// and how many processes share them, without the agent's fields. It is
// read as strictly as the agent's config.
type LimitsFile struct {
	// Count is how many processes share each limit's global rate.
	// (Optional) As the config's count; default static: 1.
	Count CountSource `json:"count,omitzero"`

	// Limits are the limits, each with unit requests and scope static.
	// (Optional) May be empty; names are unique.
	Limits []Limit `json:"limits,omitempty"`
}

// ParseLimitsFile reads a LimitsFile's contents strictly (as
// DecodeConfig), applies the defaults and validates the result: every
// limit must have unit requests (the others are the node agent's) and
// scope static (a file has no Kubernetes). It returns the file or every
// problem found.
func ParseLimitsFile(data []byte) (*LimitsFile, error) {
	f, err := decodeStrict[LimitsFile](data, "limits file", "count:, limits:")
	if err != nil {
		return nil, err
	}
	f.Default()
	if err := f.Validate(); err != nil {
		return nil, err
	}
	return f, nil
}

// Default applies every default of the file: a static count of 1 when it
// has none, and each limit's.
func (f *LimitsFile) Default() {
	if f.Count.Static == nil && f.Count.File == "" {
		one := int32(1)
		f.Count.Static = &one
	}
	for i := range f.Limits {
		f.Limits[i].Default()
	}
}

// Validate checks a defaulted LimitsFile and returns every violation,
// joined, each a *FieldError.
func (f *LimitsFile) Validate() error {
	var el errorList
	el = append(el, f.Count.validate("count")...)
	names := make(map[string]int)
	for i := range f.Limits {
		l := &f.Limits[i]
		p := index("limits", i)
		el.uniqueName("limits", i, l.Name, names)
		if l.Unit != UnitRequests {
			el.add(field(p, "unit"), "%q: this file holds the limits of a service's own processes, unit requests (the node agent enforces %s)", l.Unit, l.Unit)
			continue
		}
		el = append(el, l.RateLimitSpec.validate(p, true)...)
	}
	return errors.Join(el...)
}

// Marshal writes the config as YAML, each mapping's fields in the order of
// the Go types (a limit starts with its name). Optional fields left empty
// are left out. The comments of a file that was read are not kept.
func (c *Config) Marshal() ([]byte, error) {
	j, err := json.Marshal(c)
	if err != nil {
		return nil, fmt.Errorf("marshal config: %w", err)
	}
	// sigs.k8s.io/yaml would sort the keys; a MapSlice keeps the order
	// encoding/json wrote them in.
	var ms yamlv2.MapSlice
	if err := yamlv2.Unmarshal(j, &ms); err != nil {
		return nil, fmt.Errorf("marshal config: %w", err)
	}
	out, err := yamlv2.Marshal(ms)
	if err != nil {
		return nil, fmt.Errorf("marshal config: %w", err)
	}
	return out, nil
}

// wrap prefixes err with what was being done; several joined errors go one
// to a line under a count.
func wrap(doing string, err error) error {
	if j, ok := err.(interface{ Unwrap() []error }); ok && len(j.Unwrap()) > 1 {
		return fmt.Errorf("%s: %d errors:\n%w", doing, len(j.Unwrap()), err)
	}
	return fmt.Errorf("%s: %w", doing, err)
}

var (
	durationType      = reflect.TypeFor[metav1.Duration]()
	interfaceListType = reflect.TypeFor[InterfaceList]()
)

// requiredMappings are the fields, by the struct type that has them, whose
// value is a mapping that must be written even when it is empty: their
// zero value is a valid value ({} for match), so after decoding nothing
// tells a field left out from one written empty, and only the file can.
var requiredMappings = map[reflect.Type][]struct{ name, detail string }{
	reflect.TypeFor[Limit](): {{"match", "required: which packets the limit applies to; match: {} applies it to every ingress packet"}},
}

// toJSON checks a decoded YAML value against the Go type it will be decoded
// into (field names, and the kind of every value) and converts it to a value
// encoding/json marshals: mappings to map[string]any, numbers where a string
// belongs to their text, whole floats (2e4) to integers.
func toJSON(v any, t reflect.Type, path string) (any, []error) {
	if v == nil {
		return nil, nil // null: the field keeps its zero value
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	at := path
	if at == "" {
		at = "config"
	}
	if t == durationType {
		// A struct in Go, a string such as "100ms" in the file.
		x, ok := v.(string)
		if !ok {
			return nil, []error{wrongKind(at, `a duration such as "100ms"`, v)}
		}
		if _, err := time.ParseDuration(x); err != nil {
			return nil, []error{&FieldError{Field: at, Detail: fmt.Sprintf("%q is not a duration: a number and a unit, such as 100ms or 1.5s", x)}}
		}
		return x, nil
	}
	if t == interfaceListType {
		// A list in Go, the string auto or a list in the file.
		if x, ok := v.(string); ok {
			if x != InterfacesAuto {
				return nil, []error{&FieldError{Field: at, Detail: fmt.Sprintf("expected %s or a list of interface names, got the string %q", InterfacesAuto, x)}}
			}
			return x, nil
		}
		if _, ok := v.([]any); !ok {
			return nil, []error{wrongKind(at, InterfacesAuto+" or a list of interface names", v)}
		}
	}
	switch t.Kind() {
	case reflect.Struct:
		ms, ok := v.(yamlv2.MapSlice)
		if !ok {
			return nil, []error{wrongKind(at, "a mapping", v)}
		}
		names, types := jsonFields(t)
		var el []error
		out := make(map[string]any, len(ms))
		for _, item := range ms {
			key, ok := item.Key.(string)
			if !ok {
				el = append(el, &FieldError{Field: at, Detail: fmt.Sprintf("key %v is not a field name", item.Key)})
				continue
			}
			ft, ok := types[key]
			if !ok {
				el = append(el, unknownField(field(path, key), key, names))
				continue
			}
			fv, fel := toJSON(item.Value, ft, field(path, key))
			out[key] = fv
			el = append(el, fel...)
		}
		for _, r := range requiredMappings[t] {
			if out[r.name] == nil { // left out, or null
				el = append(el, &FieldError{Field: field(path, r.name), Detail: r.detail})
			}
		}
		return out, el
	case reflect.Slice:
		list, ok := v.([]any)
		if !ok {
			return nil, []error{wrongKind(at, "a list", v)}
		}
		var el []error
		out := make([]any, len(list))
		for i, e := range list {
			var eel []error
			out[i], eel = toJSON(e, t.Elem(), index(path, i))
			el = append(el, eel...)
		}
		return out, el
	case reflect.Map:
		// A label set (matchLabels): string keys, each value as the
		// map's element type.
		ms, ok := v.(yamlv2.MapSlice)
		if !ok {
			return nil, []error{wrongKind(at, "a mapping", v)}
		}
		var el []error
		out := make(map[string]any, len(ms))
		for _, item := range ms {
			key, ok := item.Key.(string)
			if !ok {
				el = append(el, &FieldError{Field: at, Detail: fmt.Sprintf("key %v is not a string: quote it", item.Key)})
				continue
			}
			if _, dup := out[key]; dup {
				el = append(el, &FieldError{Field: field(path, key), Detail: "listed twice"})
				continue
			}
			var fel []error
			out[key], fel = toJSON(item.Value, t.Elem(), field(path, key))
			el = append(el, fel...)
		}
		return out, el
	case reflect.String:
		switch x := v.(type) {
		case string:
			return x, nil
		case int, int64, uint64:
			return fmt.Sprint(x), nil
		case float64:
			return strconv.FormatFloat(x, 'g', -1, 64), nil
		case bool:
			return nil, []error{&FieldError{Field: at, Detail: "YAML reads this unquoted value as a boolean (yes, no, on, off, true, false): quote it"}}
		}
		return nil, []error{wrongKind(at, "a string", v)}
	case reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64, reflect.Int,
		reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uint:
		n, err := checkInteger(at, v, t)
		if err != nil {
			return nil, []error{err}
		}
		return n, nil
	case reflect.Bool:
		if b, ok := v.(bool); ok {
			return b, nil
		}
		return nil, []error{wrongKind(at, "true or false", v)}
	}
	// No field of the config has another kind; a new one needs a case above.
	return nil, []error{&FieldError{Field: at, Detail: fmt.Sprintf("cannot decode into %s", t)}}
}

// checkInteger checks that v is a whole number that fits the integer type t
// and returns it as an int64 or a uint64.
func checkInteger(at string, v any, t reflect.Type) (any, error) {
	var neg bool
	var mag uint64
	switch x := v.(type) {
	case int:
		neg, mag = x < 0, absInt(int64(x))
	case int64:
		neg, mag = x < 0, absInt(x)
	case uint64:
		mag = x
	case float64:
		if x != math.Trunc(x) || math.Abs(x) >= 1<<64 {
			return nil, &FieldError{Field: at, Detail: fmt.Sprintf("%v is not a whole number", x)}
		}
		neg, mag = x < 0, uint64(math.Abs(x))
	default:
		return nil, wrongKind(at, "a whole number", v)
	}
	z := reflect.New(t).Elem()
	var fits bool
	var lo, hi string
	if z.CanUint() {
		fits = !neg && !z.OverflowUint(mag)
		lo, hi = "0", fmt.Sprint(uint64(1)<<t.Bits()-1)
	} else {
		fits = mag <= math.MaxInt64 && !z.OverflowInt(signed(neg, mag))
		lo, hi = fmt.Sprint(-int64(1)<<(t.Bits()-1)), fmt.Sprint(int64(1)<<(t.Bits()-1)-1)
	}
	if !fits {
		return nil, &FieldError{Field: at, Detail: fmt.Sprintf("%v is out of range %s..%s", v, lo, hi)}
	}
	if neg {
		return signed(neg, mag), nil
	}
	return mag, nil
}

func absInt(x int64) uint64 {
	if x < 0 {
		return uint64(-(x + 1)) + 1
	}
	return uint64(x)
}

func signed(neg bool, mag uint64) int64 {
	if neg {
		return -int64(mag)
	}
	return int64(mag)
}

func wrongKind(at, want string, v any) error {
	var got string
	switch x := v.(type) {
	case yamlv2.MapSlice:
		got = "a mapping"
	case []any:
		got = "a list"
	case string:
		got = fmt.Sprintf("the string %q", x)
	case bool:
		got = fmt.Sprintf("the boolean %v", x)
	default:
		got = fmt.Sprintf("%v", x)
	}
	return &FieldError{Field: at, Detail: fmt.Sprintf("expected %s, got %s", want, got)}
}

func unknownField(at, key string, names []string) error {
	for _, n := range names {
		if strings.EqualFold(n, key) {
			return &FieldError{Field: at, Detail: fmt.Sprintf("unknown field: field names are case-sensitive, did you mean %s?", n)}
		}
	}
	return &FieldError{Field: at, Detail: "unknown field; valid fields: " + strings.Join(names, ", ")}
}

// jsonFields lists the JSON field names of struct type t, in order, as
// encoding/json sees them (the fields of an embedded struct without a name
// are promoted), with their types.
func jsonFields(t reflect.Type) ([]string, map[string]reflect.Type) {
	var names []string
	types := make(map[string]reflect.Type)
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case name == "-" || !f.IsExported():
			continue
		case f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct:
			n, ts := jsonFields(f.Type)
			names = append(names, n...)
			for k, v := range ts {
				types[k] = v
			}
			continue
		case name == "":
			name = f.Name
		}
		names = append(names, name)
		types[name] = f.Type
	}
	return names, types
}
