package kvm2

import (
	"bytes"
	"encoding"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"

	"github.com/egressproxy/egressproxy/internal/errs"
)

// The strict decoder of configuration files. A file (YAML, or JSON, which
// is YAML) is parsed into a node tree and walked against the Go type it
// fills, so every problem is found in one pass and named by the key path
// the person wrote (entries[2].images.deb.sha256) and its line: an unknown
// or duplicate key, a value of the wrong type, a duration that is not a
// duration string. Keys are the json tags of the Go fields, matched
// exactly (an untagged field's key is its Go name).

// maxNodeVisits bounds the walk of one document, so aliases that refer to
// aliases cannot make it expand without limit.
const maxNodeVisits = 1 << 20

// parseYAML checks that data is UTF-8 and parses its one YAML document. It
// returns nil for a document without content (an empty file).
func parseYAML(data []byte) (*yaml.Node, error) {
	if line, col, at, bad := invalidUTF8(data); bad {
		return nil, fmt.Errorf("line %d: the file is not valid UTF-8 (byte %#x in column %d)", line, data[at], col)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
		return nil, nil
	} else if err != nil {
		return nil, syntaxLine(data, err)
	}
	var more yaml.Node
	switch err := dec.Decode(&more); {
	case errors.Is(err, io.EOF):
	case err != nil:
		return nil, syntaxLine(data, err)
	default:
		return nil, fmt.Errorf("line %d: a second YAML document: the file holds one", more.Line)
	}
	if len(doc.Content) == 0 {
		return nil, nil
	}
	return doc.Content[0], nil
}

// maxSyntaxScan bounds the documents syntaxLine scans (it parses each
// prefix of one).
const maxSyntaxScan = 64 << 10

// syntaxLine gives a YAML syntax error its line when the parser's message
// has none (it leaves it out for the first line, and for some errors that
// are not the scanner's): the first line at which the document up to it
// fails with the same message.
func syntaxLine(data []byte, err error) error {
	msg := err.Error()
	if strings.HasPrefix(msg, "yaml: line ") {
		return err
	}
	if len(data) > maxSyntaxScan {
		return err
	}
	lines := bytes.SplitAfter(data, []byte("\n"))
	var prefix []byte
	for i, l := range lines {
		prefix = append(prefix, l...)
		dec := yaml.NewDecoder(bytes.NewReader(prefix))
		var perr error
		for perr == nil {
			var n yaml.Node
			perr = dec.Decode(&n)
		}
		if perr.Error() == msg {
			return fmt.Errorf("yaml: line %d: %s", i+1, strings.TrimPrefix(msg, "yaml: "))
		}
	}
	return err
}

// invalidUTF8 reports the line and column (in bytes, both 1-based) and the
// offset of the first byte of data that is not UTF-8.
func invalidUTF8(data []byte) (line, col, at int, bad bool) {
	if utf8.Valid(data) {
		return 0, 0, 0, false
	}
	line, start := 1, 0
	for i := 0; i < len(data); {
		r, size := utf8.DecodeRune(data[i:])
		if r == utf8.RuneError && size <= 1 {
			return line, i - start + 1, i, true
		}
		if r == '\n' {
			line, start = line+1, i+1
		}
		i += size
	}
	return 0, 0, 0, false
}

// decoder fills Go values from a node tree, collecting every problem.
type decoder struct {
	problems []*errs.FieldError
	// bad holds the paths that had a problem, so validation does not
	// report them a second time (a value of the wrong type is left zero).
	bad map[string]bool
	// lines holds the line of every key path decoded (its key's line; a
	// list item's own line), so validation can name it.
	lines      map[string]int
	visits     int
	overflowed bool // over has reported the walk's end
	// merging holds the mappings whose merge keys are being expanded,
	// so that a mapping that merges itself (through an alias of its own
	// anchor, directly or not) is a problem, not an endless walk.
	merging map[*yaml.Node]bool
}

// saw records the line of path.
func (d *decoder) saw(path string, line int) {
	if d.lines == nil {
		d.lines = map[string]int{}
	}
	d.lines[path] = line
}

// lineOf is the line of path or, when the file does not have it, of the
// nearest path it lies under; zero when none is known.
func (d *decoder) lineOf(path string) int {
	for p := path; p != ""; p = parentPath(p) {
		if line, ok := d.lines[p]; ok {
			return line
		}
	}
	return 0
}

func (d *decoder) add(path string, line int, value, rule string) {
	if d.bad == nil {
		d.bad = map[string]bool{}
	}
	d.bad[path] = true
	d.problems = append(d.problems, &errs.FieldError{Field: fieldName(path), Value: value, Rule: rule, Line: line})
}

// reported reports whether path, or a path it lies under, had a problem.
func (d *decoder) reported(path string) bool {
	for p := path; ; p = parentPath(p) {
		if d.bad[p] {
			return true
		}
		if p == "" {
			return false
		}
	}
}

// fieldName is path as a FieldError names it: the document itself, which
// has no key path, is "config".
func fieldName(path string) string {
	if path == "" {
		return "config"
	}
	return path
}

// parentPath cuts path's last element: "a.b[2]" → "a.b" → "a" → "".
func parentPath(p string) string {
	i := strings.LastIndexAny(p, ".[")
	if i < 0 {
		return ""
	}
	return p[:i]
}

// joinKey appends a mapping key to a key path: ".key" for a plain key,
// `["key"]` (quoted, escaped, bounded) for anything else, so a path never
// carries raw input.
func joinKey(path, key string) string {
	if !plainKey(key) {
		return path + "[" + errs.Quote(key) + "]"
	}
	if path == "" {
		return key
	}
	return path + "." + key
}

func joinIndex(path string, i int) string { return path + "[" + strconv.Itoa(i) + "]" }

// plainKey reports whether key can stand in a path as it is.
func plainKey(key string) bool {
	if key == "" || len(key) > 64 {
		return false
	}
	for i := 0; i < len(key); i++ {
		c := key[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// resolve follows aliases, counting the nodes walked.
func (d *decoder) resolve(n *yaml.Node) *yaml.Node {
	d.visits++
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
}

// over reports whether the walk has gone beyond maxNodeVisits, saying so
// (once) at path.
func (d *decoder) over(path string, line int) bool {
	if d.visits <= maxNodeVisits {
		return false
	}
	if !d.overflowed {
		d.overflowed = true
		d.add(path, line, "", "the document expands too far through aliases")
	}
	return true
}

func isNull(n *yaml.Node) bool { return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" }

// pair is one key and its value in a mapping.
type pair struct{ key, value *yaml.Node }

// pairs returns the entries of mapping n with merge keys ("<<: *base")
// resolved as YAML defines them: a key written in n wins over a merged
// one, and an earlier merged mapping over a later one. A key written twice
// in n is returned twice (the decoder reports it).
func (d *decoder) pairs(n *yaml.Node, path string) []pair {
	var own, merged []pair
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge" {
			merged = append(merged, d.mergePairs(v, path)...)
			continue
		}
		own = append(own, pair{k, v})
	}
	if len(merged) == 0 {
		return own
	}
	seen := map[string]bool{}
	for _, p := range own {
		seen[p.key.Value] = true
	}
	for _, p := range merged {
		if !seen[p.key.Value] {
			seen[p.key.Value] = true
			own = append(own, p)
		}
	}
	return own
}

// mergePairs returns the entries a merge key's value brings in: one
// mapping, or a list of them.
func (d *decoder) mergePairs(v *yaml.Node, path string) []pair {
	v = d.resolve(v)
	switch {
	case d.over(joinKey(path, "<<"), v.Line):
		return nil
	case v.Kind == yaml.MappingNode:
		return d.mergeMapping(v, path)
	case v.Kind == yaml.SequenceNode:
		var out []pair
		for _, m := range v.Content {
			if m = d.resolve(m); m.Kind != yaml.MappingNode {
				d.add(joinKey(path, "<<"), m.Line, "", "a merge key takes a mapping or a list of mappings")
				continue
			}
			out = append(out, d.mergeMapping(m, path)...)
		}
		return out
	}
	d.add(joinKey(path, "<<"), v.Line, "", "a merge key takes a mapping or a list of mappings")
	return nil
}

// mergeMapping returns the entries of mapping m that a merge key brings
// in, unless m is being merged already: a merge key inside m that refers
// to m (or to a mapping that merges m) is a problem.
func (d *decoder) mergeMapping(m *yaml.Node, path string) []pair {
	if d.merging[m] {
		d.add(joinKey(path, "<<"), m.Line, "", "a merge key may not refer to a mapping it is part of")
		return nil
	}
	if d.merging == nil {
		d.merging = map[*yaml.Node]bool{}
	}
	d.merging[m] = true
	defer delete(d.merging, m)
	return d.pairs(m, path)
}

// decode fills v from n; path is n's key path.
func (d *decoder) decode(n *yaml.Node, v reflect.Value, path string) {
	if n = d.resolve(n); d.over(path, n.Line) {
		return
	}
	if isNull(n) {
		return // as in JSON: null leaves the value as it is
	}
	t := v.Type()
	switch {
	case t == reflect.TypeFor[time.Duration]():
		d.duration(n, v, path)
		return
	case t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Uint8:
		d.bytes(n, v, path)
		return
	case decodesItself(t):
		d.viaJSON(n, v, path)
		return
	}
	switch t.Kind() {
	case reflect.Pointer:
		if v.IsNil() {
			v.Set(reflect.New(t.Elem()))
		}
		d.decode(n, v.Elem(), path)
	case reflect.Struct:
		if d.want(n, yaml.MappingNode, path) {
			d.decodeStruct(d.pairs(n, path), v, path)
		}
	case reflect.Map:
		d.decodeMap(n, v, path)
	case reflect.Slice:
		if d.want(n, yaml.SequenceNode, path) {
			s := reflect.MakeSlice(t, len(n.Content), len(n.Content))
			for i, item := range n.Content {
				d.saw(joinIndex(path, i), item.Line)
				d.decode(item, s.Index(i), joinIndex(path, i))
			}
			v.Set(s)
		}
	default:
		d.scalar(n, v, path)
	}
}

// decodesItself reports whether values of t decode themselves from JSON
// (json.Unmarshaler, encoding.TextUnmarshaler). Config is walked instead:
// its UnmarshalJSON is this decoder.
func decodesItself(t reflect.Type) bool {
	if t == reflect.TypeFor[Config]() || t.Kind() == reflect.Pointer {
		return false
	}
	p := reflect.PointerTo(t)
	return p.Implements(reflect.TypeFor[json.Unmarshaler]()) || p.Implements(reflect.TypeFor[encoding.TextUnmarshaler]())
}

// want reports whether n is of kind k, and reports a problem if not.
func (d *decoder) want(n *yaml.Node, k yaml.Kind, path string) bool {
	if n.Kind == k {
		return true
	}
	value := ""
	if n.Kind == yaml.ScalarNode {
		value = n.Value
	}
	d.add(path, n.Line, value, "must be "+kindName(k)+", not "+nodeName(n))
	return false
}

// kindName names what a node of kind k looks like in a file.
func kindName(k yaml.Kind) string {
	switch k {
	case yaml.MappingNode:
		return "a mapping (key: value lines)"
	case yaml.SequenceNode:
		return "a list"
	}
	return "a single value"
}

// nodeName names what n is: "a mapping", "a list", "a number", …
func nodeName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	switch n.ShortTag() {
	case "!!int":
		return "an integer"
	case "!!float":
		return "a floating-point number"
	case "!!bool":
		return "true or false"
	case "!!str":
		return "a string"
	case "!!null":
		return "null"
	}
	return "a value tagged " + n.ShortTag()
}

// decodeStruct fills struct v from the entries of a mapping. also are
// keys the mapping may hold that are read elsewhere (a hint may name
// them).
func (d *decoder) decodeStruct(ps []pair, v reflect.Value, path string, also ...string) {
	fields := structFields(v.Type())
	seen := map[string]int{}
	for _, p := range ps {
		k := d.resolve(p.key)
		if k.Kind != yaml.ScalarNode {
			d.add(path, k.Line, "", "a key must be a single value, not "+nodeName(k))
			continue
		}
		kp := joinKey(path, k.Value)
		if first, dup := seen[k.Value]; dup {
			d.add(kp, k.Line, "", fmt.Sprintf("is given twice (first on line %d)", first))
			continue
		}
		seen[k.Value] = k.Line
		d.saw(kp, k.Line)
		f, ok := fields.byKey[k.Value]
		if !ok {
			d.add(kp, k.Line, "", "unknown key"+keyHint(k.Value, append(append([]string(nil), also...), fields.keys...)))
			continue
		}
		d.decode(p.value, v.FieldByIndex(f.index), kp)
	}
}

// decodeMap fills map v (string keys) from a mapping.
func (d *decoder) decodeMap(n *yaml.Node, v reflect.Value, path string) {
	t := v.Type()
	if t.Key().Kind() != reflect.String {
		d.add(path, n.Line, "", "cannot be read from a file (Go type "+t.String()+")")
		return
	}
	if !d.want(n, yaml.MappingNode, path) {
		return
	}
	if v.IsNil() {
		v.Set(reflect.MakeMap(t))
	}
	seen := map[string]int{}
	for _, p := range d.pairs(n, path) {
		k := d.resolve(p.key)
		if k.Kind != yaml.ScalarNode || isNull(k) {
			d.add(path, k.Line, "", "a key must be a single value, not "+nodeName(k))
			continue
		}
		kp := joinKey(path, k.Value)
		if first, dup := seen[k.Value]; dup {
			d.add(kp, k.Line, "", fmt.Sprintf("is given twice (first on line %d)", first))
			continue
		}
		seen[k.Value] = k.Line
		d.saw(kp, k.Line)
		e := reflect.New(t.Elem()).Elem()
		d.decode(p.value, e, kp)
		v.SetMapIndex(reflect.ValueOf(k.Value).Convert(t.Key()), e)
	}
}

// scalar fills a string, bool, number or interface value.
func (d *decoder) scalar(n *yaml.Node, v reflect.Value, path string) {
	if v.Kind() == reflect.Interface && v.NumMethod() == 0 {
		var x any
		if err := n.Decode(&x); err != nil {
			d.add(path, n.Line, "", yamlMessage(err))
		} else if x != nil {
			v.Set(reflect.ValueOf(x))
		}
		return
	}
	if !d.want(n, yaml.ScalarNode, path) {
		return
	}
	if v.Kind() == reflect.String {
		if n.ShortTag() != "!!str" {
			d.add(path, n.Line, n.Value, "must be a string, not "+nodeName(n)+`: quote it ("`+n.Value+`")`)
			return
		}
		v.SetString(n.Value)
		return
	}
	switch ok, known := setScalar(n, v); {
	case !known:
		d.add(path, n.Line, "", "cannot be read from a file (Go type "+v.Type().String()+")")
	case !ok && n.ShortTag() == "!!int" && v.Kind() != reflect.Bool:
		d.add(path, n.Line, n.Value, fmt.Sprintf("is out of range (%s of %d bits)", scalarName(v.Type()), v.Type().Bits()))
	case !ok:
		d.add(path, n.Line, n.Value, "must be "+scalarName(v.Type())+", not "+nodeName(n))
	}
}

// setScalar fills a bool or number from n. known is false for a value of
// another kind; ok is false when n does not fit it.
func setScalar(n *yaml.Node, v reflect.Value) (ok, known bool) {
	tag := n.ShortTag()
	switch v.Kind() {
	case reflect.Bool:
		var b bool
		if ok = tag == "!!bool" && n.Decode(&b) == nil; ok {
			v.SetBool(b)
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		var i int64
		if ok = tag == "!!int" && n.Decode(&i) == nil && !v.OverflowInt(i); ok {
			v.SetInt(i)
		}
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		var u uint64
		if ok = tag == "!!int" && n.Decode(&u) == nil && !v.OverflowUint(u); ok {
			v.SetUint(u)
		}
	case reflect.Float32, reflect.Float64:
		var f float64
		if ok = (tag == "!!float" || tag == "!!int") && n.Decode(&f) == nil && !v.OverflowFloat(f); ok {
			v.SetFloat(f)
		}
	default:
		return false, false
	}
	return ok, true
}

// scalarName says what a value of Go type t is written as.
func scalarName(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a non-negative integer"
	}
	return "a number"
}

// durationRule is the rule a configured duration breaks.
const durationRule = `must be a duration such as "30s", "2m" or "1h30m" (Go's time.ParseDuration syntax)`

// duration fills a time.Duration from a duration string. A bare number is
// refused: it would read as nanoseconds.
func (d *decoder) duration(n *yaml.Node, v reflect.Value, path string) {
	if !d.want(n, yaml.ScalarNode, path) {
		return
	}
	switch n.ShortTag() {
	case "!!str":
		x, err := time.ParseDuration(n.Value)
		if err != nil {
			d.add(path, n.Line, n.Value, durationRule)
			return
		}
		v.SetInt(int64(x))
	case "!!int", "!!float":
		d.add(path, n.Line, n.Value, durationRule+"; a bare number would be read as nanoseconds: give its unit")
	default:
		d.add(path, n.Line, n.Value, durationRule+", not "+nodeName(n))
	}
}

// bytes fills a []byte with the text as written (a block scalar keeps
// its lines), or with base64 data tagged !!binary.
func (d *decoder) bytes(n *yaml.Node, v reflect.Value, path string) {
	if !d.want(n, yaml.ScalarNode, path) {
		return
	}
	switch n.ShortTag() {
	case "!!str":
		v.SetBytes([]byte(n.Value))
	case "!!binary":
		b, err := base64.StdEncoding.DecodeString(strings.Join(strings.Fields(n.Value), ""))
		if err != nil {
			d.add(path, n.Line, "", "is tagged !!binary but is not base64")
			return
		}
		v.SetBytes(b)
	default:
		d.add(path, n.Line, n.Value, "must be text, not "+nodeName(n))
	}
}

// viaJSON fills a value that decodes itself (json.Unmarshaler,
// encoding.TextUnmarshaler) from n in JSON form.
func (d *decoder) viaJSON(n *yaml.Node, v reflect.Value, path string) {
	var x any
	if err := n.Decode(&x); err != nil {
		d.add(path, n.Line, "", yamlMessage(err))
		return
	}
	b, err := json.Marshal(x)
	if err == nil {
		err = json.Unmarshal(b, v.Addr().Interface())
	}
	if err != nil {
		d.add(path, n.Line, "", errs.ClipMessage(err.Error()))
	}
}

// yamlMessage is err's text without the "yaml: " prefix.
func yamlMessage(err error) string { return strings.TrimPrefix(err.Error(), "yaml: ") }

// fileField is one decodable field of a struct.
type fileField struct {
	key   string
	index []int
}

// fieldSet is the decodable fields of a struct type by key, and the keys in
// field order.
type fieldSet struct {
	byKey map[string]fileField
	keys  []string
}

// structFields lists t's fields as encoding/json sees them: the json tag's
// name, or the Go name when untagged; "-" and unexported fields skipped;
// the fields of an untagged embedded struct promoted.
func structFields(t reflect.Type) fieldSet {
	fs := fieldSet{byKey: map[string]fileField{}}
	var walk func(t reflect.Type, index []int)
	walk = func(t reflect.Type, index []int) {
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			tag, tagged := f.Tag.Lookup("json")
			name, _, _ := strings.Cut(tag, ",")
			idx := append(append([]int(nil), index...), i)
			switch {
			case name == "-" && tag == "-":
				continue
			case f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct:
				walk(f.Type, idx)
				continue
			case !f.IsExported():
				continue
			case !tagged || name == "":
				name = f.Name
			}
			if _, dup := fs.byKey[name]; !dup {
				fs.byKey[name] = fileField{key: name, index: idx}
				fs.keys = append(fs.keys, name)
			}
		}
	}
	walk(t, nil)
	return fs
}

// keyHint says which key an unknown one was probably meant to be: the key
// that differs only in case (a Go field name written as a key), or the one
// a typo away; or lists the keys when there are few.
func keyHint(key string, keys []string) string {
	for _, k := range keys {
		if strings.EqualFold(k, key) {
			return "; keys are camelCase: write " + k
		}
	}
	best, bestDist, ties := "", 3, 0
	for _, k := range keys {
		switch dist := editDistance(strings.ToLower(key), strings.ToLower(k)); {
		case dist < bestDist:
			best, bestDist, ties = k, dist, 0
		case dist == bestDist:
			ties++
		}
	}
	if best != "" && ties == 0 && bestDist < len(best) {
		return "; did you mean " + best + "?"
	}
	if len(keys) > 0 && len(keys) <= 8 {
		sorted := append([]string(nil), keys...)
		sort.Strings(sorted)
		return " (keys: " + strings.Join(sorted, ", ") + ")"
	}
	return ""
}

// editDistance is the Levenshtein distance of a and b, up to 3 (larger
// distances are 3: only near misses matter).
func editDistance(a, b string) int {
	if len(a) > 64 || len(b) > 64 {
		return 3
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return min(prev[len(b)], 3)
}
