package kvm2

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"maps"
	"net"
	"path"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// Defaults of zero Config fields, and bounds.
const (
	defaultLibvirtSocket      = "/var/run/libvirt/libvirt-sock"
	defaultLibvirtURI         = "qemu:///system"
	defaultDomainType         = "qemu" // the fallback of a zero (automatic) DomainType on a host without KVM
	defaultNetwork            = "default"
	defaultMachineTypeName    = "small"
	defaultCallTimeout        = 2 * time.Minute
	defaultMachineTypeVCPUs   = 1
	defaultMachineTypeMemory  = 512
	maxMachineTypeVCPUs       = 256
	minMachineTypeMemoryMiB   = 64
	maxMachineTypeMemoryMiB   = 1 << 22 // 4 TiB
	maxLibvirtObjectNameBytes = 255
	maxBridgeNameBytes        = 15
	// minClaimTimeout is the shortest non-zero ClaimTimeout: a claim is
	// then refreshed every 2.5 s and given up after 5 s without a
	// refresh. Much shorter would let one slow libvirt call cost a fetch,
	// and leave little room for clock skew between the processes sharing
	// a pool (they must agree to within ClaimTimeout/2).
	minClaimTimeout = 10 * time.Second
)

// fieldErr returns a *errs.FieldError. The value is given as is: the
// error's text quotes it escaped and bounded (errs.Quote).
func fieldErr(field, value, rule string) error {
	return &errs.FieldError{Field: field, Value: value, Rule: rule}
}

// step is one element of a path into a Config: a Go field name, or a map
// key.
type step struct {
	name  string
	isKey bool
}

func fieldStep(name string) step { return step{name: name} }
func keyStep(key string) step    { return step{name: key, isKey: true} }

// problem is one rule broken by one field of a Config. Its path is
// rendered as the Go field path (a Config given to Open) or as the key
// path in a file (ParseConfig, ParseEntries). A rule names other fields
// of the Config as {GoName}, rendered the same way.
type problem struct {
	path  []step
	value string
	rule  string
}

// checker collects the problems of one Config.
type checker struct{ problems []problem }

func (k *checker) add(value, rule string, path ...step) {
	k.problems = append(k.problems, problem{path: path, value: value, rule: rule})
}

// addErr adds the *errs.FieldErrors in err, their Field (a dotted Go
// path) below prefix.
func (k *checker) addErr(err error, prefix ...step) {
	for _, fe := range errs.FieldErrors(err) {
		p := append([]step(nil), prefix...)
		if fe.Field != "" {
			for _, name := range strings.Split(fe.Field, ".") {
				p = append(p, fieldStep(name))
			}
		}
		k.add(fe.Value, fe.Rule, p...)
	}
}

// check returns every rule c breaks. A file (requireCredentials false)
// may leave the key source and the known_hosts source to the program;
// Open requires them. hasSigner: Options.Signer is the key source.
func (c Config) check(requireCredentials, hasSigner bool) []problem {
	var k checker
	k.identity(c)
	k.credentials(c, requireCredentials, hasSigner)
	k.knownHosts(c, requireCredentials)
	k.libvirt(c)
	k.nic(c)
	k.boot(c)
	k.machineTypes(c)
	k.images(c)
	k.timeouts(c)
	return k.problems
}

func (k *checker) identity(c Config) {
	k.addErr(naming.ValidateName("Entry", c.Entry))
	k.addErr(naming.ValidateName("Owner", c.Owner))
	if c.Address == "" {
		k.add("", "is required (host:port of sshd)", fieldStep("Address"))
	} else if host, port, err := net.SplitHostPort(c.Address); err != nil {
		k.add(c.Address, "must be host:port", fieldStep("Address"))
	} else if host == "" {
		k.add(c.Address, "host must not be empty", fieldStep("Address"))
	} else if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		k.add(c.Address, "port must be a number in 1-65535", fieldStep("Address"))
	}
	if c.User == "" {
		k.add("", "is required", fieldStep("User"))
	} else if strings.ContainsAny(c.User, " \t\r\n@:/") {
		k.add(c.User, "must not contain spaces, '@', ':' or '/'", fieldStep("User"))
	}
}

// credentials checks the key sources: at most one (exactly one for Open),
// a passphrase only for a key it can decrypt. No problem carries a
// secret: a value is a path at most.
func (k *checker) credentials(c Config, require, hasSigner bool) {
	given := map[string]bool{"{KeyFile}": c.KeyFile != "", "{AgentSocket}": c.AgentSocket != "", "Key": len(c.Key) > 0, "Options.Signer": hasSigner}
	all := []string{"{KeyFile}", "{AgentSocket}", "Key", "Options.Signer"}
	var set []string
	for _, name := range all {
		if given[name] {
			set = append(set, name)
		}
	}
	switch {
	case len(set) == 0 && require:
		k.add("", "a client key is required: set {KeyFile} or {AgentSocket}, or in code Key or Options.Signer", fieldStep("KeyFile"))
	case len(set) > 1:
		for _, name := range set {
			if name == "Options.Signer" {
				continue // not a Config field: the others name it
			}
			k.add("", "set only one key source of "+strings.Join(all, ", ")+" (also set: "+strings.Join(others(set, name), ", ")+")",
				fieldStep(strings.Trim(name, "{}")))
		}
	}
	if len(c.KeyPassphrase) > 0 && c.KeyFile == "" && len(c.Key) == 0 {
		k.add("", "applies only to {KeyFile} or Key", fieldStep("KeyPassphrase"))
	}
	if c.AgentSocket != "" && !filepath.IsAbs(c.AgentSocket) {
		k.add(c.AgentSocket, "must be an absolute path (the agent's unix socket)", fieldStep("AgentSocket"))
	}
}

func others(set []string, name string) []string {
	var out []string
	for _, s := range set {
		if s != name {
			out = append(out, s)
		}
	}
	return out
}

// knownHosts checks the host key pin: at most one source (exactly one
// for Open), KnownHosts with at least one known_hosts line.
func (k *checker) knownHosts(c Config, require bool) {
	switch {
	case c.KnownHostsFile == "" && len(c.KnownHosts) == 0 && require:
		k.add("", "is required, or {KnownHosts} (host key verification cannot be skipped)", fieldStep("KnownHostsFile"))
	case c.KnownHostsFile != "" && len(c.KnownHosts) > 0:
		k.add("", "set only one of {KnownHostsFile} and {KnownHosts} (also set: {KnownHosts})", fieldStep("KnownHostsFile"))
		k.add("", "set only one of {KnownHostsFile} and {KnownHosts} (also set: {KnownHostsFile})", fieldStep("KnownHosts"))
	}
	if len(c.KnownHosts) == 0 || hasKnownHostsLine(c.KnownHosts) {
		return
	}
	rule := `must hold at least one known_hosts line ("host key-type key")`
	if b, err := base64.StdEncoding.DecodeString(string(bytes.TrimSpace(c.KnownHosts))); err == nil && hasKnownHostsLine(b) {
		rule += `; this is base64: write the lines themselves (in YAML a block: "knownHosts: |" with the lines indented below)`
	}
	k.add("", rule, fieldStep("KnownHosts"))
}

// hasKnownHostsLine reports whether b holds at least one line that parses
// as a known_hosts entry.
func hasKnownHostsLine(b []byte) bool {
	for _, line := range bytes.Split(b, []byte("\n")) {
		if _, _, _, _, _, err := ssh.ParseKnownHosts(line); err == nil {
			return true
		}
	}
	return false
}

func (k *checker) libvirt(c Config) {
	if c.LibvirtSocket != "" && !path.IsAbs(c.LibvirtSocket) {
		k.add(c.LibvirtSocket, "must be an absolute path on the host", fieldStep("LibvirtSocket"))
	}
	if c.LibvirtURI != "" && !strings.Contains(c.LibvirtURI, "://") {
		k.add(c.LibvirtURI, `must be a libvirt URI such as "qemu:///system"`, fieldStep("LibvirtURI"))
	}
	k.objectName("Pool", c.Pool, true)
	switch c.DomainType {
	case "", domainTypeQEMU, domainTypeKVM: // "": automatic (decided on first use)
	default:
		k.add(c.DomainType, `must be "kvm", "qemu", or empty (automatic)`, fieldStep("DomainType"))
	}
}

// nic checks the NIC's attachment: a libvirt network or a bridge.
func (k *checker) nic(c Config) {
	switch {
	case c.Network != "" && c.Bridge != "":
		k.add(c.Bridge, "must be empty when {Network} is set (one NIC: a libvirt network or a bridge)", fieldStep("Bridge"))
	case c.Bridge != "":
		if len(c.Bridge) > maxBridgeNameBytes || strings.ContainsAny(c.Bridge, " /\t\r\n") {
			k.add(c.Bridge, fmt.Sprintf("must be an interface name (at most %d characters, no spaces or '/')", maxBridgeNameBytes), fieldStep("Bridge"))
		}
	default:
		k.objectName("Network", c.Network, false)
	}
}

// boot checks direct kernel boot and the console log.
func (k *checker) boot(c Config) {
	if c.Kernel != "" && !path.IsAbs(c.Kernel) {
		k.add(c.Kernel, "must be an absolute path on the host", fieldStep("Kernel"))
	}
	if c.Initrd != "" {
		if c.Kernel == "" {
			k.add(c.Initrd, "requires {Kernel}", fieldStep("Initrd"))
		} else if !path.IsAbs(c.Initrd) {
			k.add(c.Initrd, "must be an absolute path on the host", fieldStep("Initrd"))
		}
	}
	if c.Cmdline != "" && c.Kernel == "" {
		k.add(c.Cmdline, "requires {Kernel}", fieldStep("Cmdline"))
	}
	if c.ConsoleLogDir != "" && !path.IsAbs(c.ConsoleLogDir) {
		k.add(c.ConsoleLogDir, "must be an absolute path on the host", fieldStep("ConsoleLogDir"))
	}
}

// objectName checks a libvirt object name (pool, network): no '/', no
// control characters, at most 255 bytes.
func (k *checker) objectName(field, name string, required bool) {
	switch {
	case name == "":
		if required {
			k.add("", "is required", fieldStep(field))
		}
	case len(name) > maxLibvirtObjectNameBytes:
		k.add(name, fmt.Sprintf("is %d bytes, at most %d allowed", len(name), maxLibvirtObjectNameBytes), fieldStep(field))
	case strings.ContainsFunc(name, func(r rune) bool { return r < 0x20 || r == 0x7f || r == '/' }):
		k.add(name, "must not contain '/' or control characters", fieldStep(field))
	}
}

func (k *checker) machineTypes(c Config) {
	for _, name := range sortedKeys(c.MachineTypes) {
		mt := c.MachineTypes[name]
		at := []step{fieldStep("MachineTypes"), keyStep(name)}
		if k.mapKey(name, at) {
			continue
		}
		if mt.VCPUs < 1 || mt.VCPUs > maxMachineTypeVCPUs {
			k.add(strconv.Itoa(mt.VCPUs), fmt.Sprintf("must be 1-%d", maxMachineTypeVCPUs), append(at, fieldStep("VCPUs"))...)
		}
		if mt.MemoryMiB < minMachineTypeMemoryMiB || mt.MemoryMiB > maxMachineTypeMemoryMiB {
			k.add(strconv.Itoa(mt.MemoryMiB), fmt.Sprintf("must be %d-%d", minMachineTypeMemoryMiB, maxMachineTypeMemoryMiB), append(at, fieldStep("MemoryMiB"))...)
		}
	}
	_, known := c.MachineTypes[c.DefaultMachineType]
	switch {
	case c.DefaultMachineType == "":
		if len(c.MachineTypes) > 1 {
			k.add("", "is required when {MachineTypes} has several entries", fieldStep("DefaultMachineType"))
		}
	case len(c.MachineTypes) == 0:
		if c.DefaultMachineType != defaultMachineTypeName {
			k.add(c.DefaultMachineType, "must be a key of {MachineTypes} (without machine types: "+defaultMachineTypeName+")", fieldStep("DefaultMachineType"))
		}
	case !known:
		k.add(c.DefaultMachineType, "must be a key of {MachineTypes}", fieldStep("DefaultMachineType"))
	}
}

// mapKey checks an image key or machine type name with the one key rule
// (naming.ValidateKey) and reports whether it broke it. The path names
// the key, so the problem does not repeat it as its value.
func (k *checker) mapKey(key string, at []step) bool {
	fes := errs.FieldErrors(naming.ValidateKey("key", key))
	for _, fe := range fes {
		k.add("", fe.Rule, at...)
	}
	return len(fes) > 0
}

func (k *checker) timeouts(c Config) {
	negative := func(field string, d time.Duration, zero string) {
		if d < 0 {
			k.add(d.String(), "must not be negative (zero means "+zero+")", fieldStep(field))
		}
	}
	negative("TransferBudget", c.TransferBudget, "the image cache's default, 20m")
	if c.ClaimTimeout != 0 && c.ClaimTimeout < minClaimTimeout {
		k.add(c.ClaimTimeout.String(), fmt.Sprintf("must be zero (the image cache's default, 2m) or at least %s (the claim is refreshed every {ClaimTimeout}/4)", minClaimTimeout), fieldStep("ClaimTimeout"))
	}
	negative("CallTimeout", c.CallTimeout, "2m")
	negative("DialTimeout", c.DialTimeout, "10s")
	negative("KeepaliveInterval", c.KeepaliveInterval, "5s")
	if c.KeepaliveCount < 0 {
		k.add(strconv.Itoa(c.KeepaliveCount), "must not be negative (zero means 3)", fieldStep("KeepaliveCount"))
	}
}

// withDefaults returns c with every zero field that has a default set to
// it, and each image's Key set to its map key. c has passed check.
func (c Config) withDefaults() Config {
	if c.LibvirtSocket == "" {
		c.LibvirtSocket = defaultLibvirtSocket
	}
	if c.LibvirtURI == "" {
		c.LibvirtURI = defaultLibvirtURI
	}
	if c.Network == "" && c.Bridge == "" {
		c.Network = defaultNetwork
	}
	if c.CallTimeout == 0 {
		c.CallTimeout = defaultCallTimeout
	}
	if len(c.MachineTypes) == 0 {
		c.MachineTypes = map[string]MachineType{defaultMachineTypeName: {VCPUs: defaultMachineTypeVCPUs, MemoryMiB: defaultMachineTypeMemory}}
	} else {
		c.MachineTypes = maps.Clone(c.MachineTypes)
	}
	if c.DefaultMachineType == "" {
		c.DefaultMachineType = onlyKey(c.MachineTypes)
	}
	c.Images = imagesWithKeys(c.Images)
	if c.DefaultImage == "" {
		c.DefaultImage = onlyKey(c.Images)
	}
	return c
}

// onlyKey is the key of a map with one key, or "".
func onlyKey[V any](m map[string]V) string {
	if len(m) != 1 {
		return ""
	}
	for k := range m {
		return k
	}
	return ""
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// goFieldErrors renders problems for a Config given in Go: each Field is
// the Go field path (Images["deb"].SHA256).
func goFieldErrors(problems []problem) []*errs.FieldError {
	out := make([]*errs.FieldError, len(problems))
	for i, p := range problems {
		var b strings.Builder
		for j, s := range p.path {
			switch {
			case s.isKey:
				b.WriteString("[" + errs.Quote(s.name) + "]")
			case j > 0:
				b.WriteString("." + s.name)
			default:
				b.WriteString(s.name)
			}
		}
		out[i] = &errs.FieldError{Field: b.String(), Value: p.value, Rule: renderRule(p.rule, false)}
	}
	return out
}

// checkFile adds the problems of c, an entry read at key path base, each
// named by its key path in the file with its line; a path whose value the
// decoder already refused is not reported again.
func (d *decoder) checkFile(c Config, base string) {
	if d.overflowed {
		return // the entry was not read to its end: its problems are unknown
	}
	for _, p := range c.check(false, false) {
		at := filePath(base, p.path)
		if d.reported(at) {
			continue
		}
		d.problems = append(d.problems, &errs.FieldError{Field: fieldName(at), Value: p.value, Rule: renderRule(p.rule, true), Line: d.lineOf(at)})
	}
}

// filePath renders a path into a Config as the key path in a file, below
// base.
func filePath(base string, p []step) string {
	at, t := base, reflect.TypeFor[Config]()
	for _, s := range p {
		key := s.name
		switch t.Kind() {
		case reflect.Map:
			t = t.Elem()
		case reflect.Struct:
			if f, ok := t.FieldByName(s.name); ok {
				key, t = fileKey(f), f.Type
			}
		}
		at = joinKey(at, key)
	}
	return at
}

// fileKey is the key of struct field f in a file: its json name.
func fileKey(f reflect.StructField) string {
	if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name != "" && name != "-" {
		return name
	}
	return f.Name
}

// renderRule replaces the {GoName} references to Config fields in rule
// with the field's Go name, or with its key for a file.
func renderRule(rule string, file bool) string {
	if !strings.Contains(rule, "{") {
		return rule
	}
	t := reflect.TypeFor[Config]()
	var pairs []string
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name := f.Name
		if file {
			name = fileKey(f)
		}
		pairs = append(pairs, "{"+f.Name+"}", name)
	}
	return strings.NewReplacer(pairs...).Replace(rule)
}
