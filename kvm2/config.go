package kvm2

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"sort"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.yaml.in/yaml/v3"
	"golang.org/x/crypto/ssh"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/duration"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// MachineType is the size of a VM.
type MachineType struct {
	// VCPUs is the number of virtual CPUs, 1–256.
	VCPUs int `json:"vcpus"`
	// MemoryMiB is the guest memory in MiB, at least 64.
	MemoryMiB int `json:"memoryMiB"`
}

// Config describes one provider entry: one hypervisor host reached over SSH
// and one libvirt storage pool on it. Every field documents its zero value.
// Open validates it (errors name the Go field and the rule, e.g.
// Images["deb"].SHA256) and touches nothing.
//
// Config is data an operator keeps in a file, a ConfigMap or a Secret: it
// marshals to JSON and YAML with camelCase keys (the json tags), durations
// as strings ("30s"), zero values that mean "the default" omitted.
// ParseConfig reads one entry from a file and ParseEntries a list of them,
// strictly, naming each problem by its key path in the file. Secrets never
// appear in its marshalled form or its String: image URLs are written with
// their credentials redacted and the key fields are tagged `json:"-"`, so they
// are set in code (from a Secret), never from the file.
type Config struct {
	// Entry is the provider entry name. It becomes part of volume and domain
	// names, so it must be a lowercase DNS label (1–63 of a–z, 0–9, '-',
	// alphanumeric at both ends, no "--"). Required.
	Entry string `json:"entry"`
	// Owner names the program (e.g. the operator instance) that owns the
	// instances; it is stored in each domain's metadata and List returns only
	// instances of this Owner. Same rule as Entry. Required.
	Owner string `json:"owner"`

	// Address is host:port of the hypervisor's sshd. Required.
	Address string `json:"address"`
	// User is the SSH user. Required.
	User string `json:"user"`
	// KeyFile is a private key file (OpenSSH or PEM), unencrypted or
	// encrypted with KeyPassphrase. The client key comes from exactly one of
	// KeyFile, Key, AgentSocket and Options.Signer (Open names the fields
	// when none or several are set; a file may leave it to the program).
	// Zero: one of the others. It is read on every dial (a missing file is
	// reported by Check as CredentialsUnavailable, not by Open).
	KeyFile string `json:"keyFile,omitempty"`
	// KnownHostsFile is an OpenSSH known_hosts file pinning the host key.
	// Host keys are pinned by exactly one of KnownHostsFile and KnownHosts:
	// host key verification cannot be skipped. Zero: KnownHosts.
	KnownHostsFile string `json:"knownHostsFile,omitempty"`
	// Key is a private key in PEM form (OpenSSH or PKCS#1/PKCS#8/SEC 1),
	// unencrypted or encrypted with KeyPassphrase: for a key held in memory,
	// e.g. read from a Kubernetes Secret. It never appears in a marshalled
	// Config, an error or a log line. Zero: another key source.
	Key []byte `json:"-"`
	// KeyPassphrase decrypts KeyFile or Key. It never appears in a
	// marshalled Config, an error or a log line. Zero: the key is
	// unencrypted; setting it without KeyFile or Key is invalid.
	KeyPassphrase []byte `json:"-"`
	// AgentSocket is the absolute path of an ssh-agent's unix socket (what
	// SSH_AUTH_SOCK names): each SSH dial opens its own agent connection,
	// offers every key the agent holds and closes it after the handshake.
	// Zero: another key source.
	AgentSocket string `json:"agentSocket,omitempty"`
	// KnownHosts is the content of a known_hosts file, for host keys held in
	// a ConfigMap, a Secret or the config file itself, where it is text (a
	// string in JSON; in YAML a block, "knownHosts: |" with the lines
	// indented below). Both it and KnownHostsFile accept hashed names,
	// "[host]:port", patterns, @cert-authority lines (host certificates
	// signed by that CA) and @revoked lines. Zero: KnownHostsFile.
	KnownHosts []byte `json:"knownHosts,omitempty"`
	// LibvirtSocket is the absolute path of libvirtd's read-write unix
	// socket on the host. Zero: /var/run/libvirt/libvirt-sock.
	LibvirtSocket string `json:"libvirtSocket,omitempty"`
	// LibvirtURI is the connection URI sent to libvirtd (it contains
	// "://"). Zero: qemu:///system.
	LibvirtURI string `json:"libvirtURI,omitempty"`
	// Pool is the libvirt storage pool holding base images, overlays and
	// seeds (no '/' or control characters, at most 255 bytes). Required.
	Pool string `json:"pool"`

	// Images maps an image key (egressproxy.Spec.ImageKey: 1–63 of a–z,
	// 0–9, '.', '-', alphanumeric at both ends, no "--") to the base image
	// the instance's overlay is backed by; package imagecache fetches,
	// verifies and publishes it in Pool. An Image's Key may be left empty
	// (it is set from the map key); when set it must equal the map key.
	// Zero: no images — Check works, Create fails Permanent.
	Images map[string]imagecache.Image `json:"images,omitempty"`
	// DefaultImage is used when a Spec names no image. Zero: the only key
	// when Images has one key; required when it has several.
	DefaultImage string `json:"defaultImage,omitempty"`
	// TransferBudget bounds one cold image fetch: download, upload,
	// read-back, publish. Zero: 20m; not negative.
	TransferBudget time.Duration `json:"transferBudget,omitempty"`
	// ClaimTimeout is the image cache's claim timeout. A process fetching a base into
	// Pool holds a claim on it and refreshes it every ClaimTimeout/4; a
	// claim not refreshed for ClaimTimeout is stale and another process
	// takes it over. So it is how long an image stays blocked on this
	// host after the process fetching it died (a replica killed mid-fetch):
	// an operator with leader election sets it near its lease duration,
	// so the next leader's Create does not wait on the dead one's claim
	// much longer than on its Lease. A holder that could not refresh for
	// ClaimTimeout/2 gives its fetch up (Transient), so a claim is never
	// taken over while its holder works; that needs the clocks of the
	// processes sharing the pool to agree to well within ClaimTimeout/2.
	// Every process sharing the pool should use the same value. Zero:
	// imagecache's default (2m); otherwise at least 10s.
	ClaimTimeout time.Duration `json:"claimTimeout,omitempty"`

	// MachineTypes maps a machine type name (egressproxy.Spec.MachineType,
	// the same rule as an image key) to its size. Zero: {"small": {VCPUs:
	// 1, MemoryMiB: 512}}.
	MachineTypes map[string]MachineType `json:"machineTypes,omitempty"`
	// DefaultMachineType is used when a Spec names none; a key of
	// MachineTypes. Zero: "small" when MachineTypes is empty, the only key
	// when it has one key; required when it has several.
	DefaultMachineType string `json:"defaultMachineType,omitempty"`

	// Network is the libvirt network the VM's NIC joins (no '/' or control
	// characters, at most 255 bytes). Zero: "default", unless Bridge is set.
	// Setting both is an error.
	Network string `json:"network,omitempty"`
	// Bridge is a host bridge the VM's NIC joins instead of a libvirt
	// network (an interface name: at most 15 characters, no spaces or '/').
	// Zero: use Network.
	Bridge string `json:"bridge,omitempty"`
	// DomainType is the libvirt domain type: "kvm" (hardware acceleration)
	// or "qemu" (TCG, software emulation, works everywhere). Zero:
	// automatic — "kvm" when the host's domain capabilities offer it, else
	// "qemu", which Check reports as a degraded detail; decided on first
	// use (Open touches nothing). An explicit "kvm" on a host that does not
	// offer it fails Create and Check (Permanent, naming DomainType). A host
	// may offer KVM that does not work (e.g. nested virtualisation, where
	// KVM guests hang in their firmware): pin "qemu" there.
	DomainType string `json:"domainType,omitempty"`

	// Kernel, when set, is the absolute path on the host of a kernel to boot
	// directly (direct kernel boot) instead of the disk's boot loader. Zero:
	// boot from the disk.
	Kernel string `json:"kernel,omitempty"`
	// Initrd is the absolute path on the host of the initrd for direct
	// kernel boot. Zero: none. Requires Kernel.
	Initrd string `json:"initrd,omitempty"`
	// Cmdline is the kernel command line for direct kernel boot. Zero: none.
	// Requires Kernel.
	Cmdline string `json:"cmdline,omitempty"`

	// ConsoleLogDir, when set, is an absolute directory on the host where
	// each VM's serial console is logged as "<domain>.log" (written by
	// virtlogd). Zero: the console is a pty only, nothing is logged.
	ConsoleLogDir string `json:"consoleLogDir,omitempty"`

	// CallTimeout is the budget of one backend call when the caller's
	// context has no deadline. Zero: 2m; not negative. A call it ends is
	// Transient (the caller's own deadline is DeadlineExceeded); so is a
	// dial that DialTimeout ends.
	CallTimeout time.Duration `json:"callTimeout,omitempty"`
	// DialTimeout bounds the SSH dial and handshake. Zero: 10s; not
	// negative.
	DialTimeout time.Duration `json:"dialTimeout,omitempty"`
	// KeepaliveInterval and KeepaliveCount tune SSH liveness: a keepalive
	// every KeepaliveInterval, the link is dead after KeepaliveCount
	// unanswered ones. Zero: 5s and 3; not negative.
	KeepaliveInterval time.Duration `json:"keepaliveInterval,omitempty"`
	KeepaliveCount    int           `json:"keepaliveCount,omitempty"`
}

// Options are optional collaborators. A nil *Options is valid.
type Options struct {
	// Signer signs with a key the program holds (a hardware token, its own
	// agent client) instead of a key source of the Config; it must be safe
	// for concurrent use. Nil: the Config's key source.
	Signer ssh.Signer
	// Logger receives the provider's log lines. Zero value: discard. The
	// provider never writes to stdout or stderr.
	Logger logr.Logger
	// TracerProvider creates a span per backend call. Nil: no-op.
	TracerProvider trace.TracerProvider
	// MeterProvider records the entry's metrics, each labelled with its
	// egressproxy.entry: the client's operation durations and the facts
	// of its last Check, every libvirt remote procedure call, the SSH
	// connection's state and redials, and its image cache's (bytes
	// fetched by source, fetch durations, failed checks, evictions, the
	// bases it holds). Nil: no-op.
	MeterProvider metric.MeterProvider
	// HTTPClient downloads base images. Nil: imagecache's default (no
	// overall timeout; the transfer budget bounds a download).
	HTTPClient *http.Client
	// ImageProgress, when set, is called during a cold image fetch (the
	// first Create that needs a base the host lacks) with the transfer's
	// progress, at most every ImageProgressInterval and once when the
	// upload ends, from the goroutine doing the fetch: it must return
	// quickly and not call the provider. Progress.Volume names the base.
	// Nil: progress is only logged (V(1)).
	ImageProgress func(imagecache.Progress)
	// ImageProgressInterval is the interval of ImageProgress and of the
	// progress log lines. Zero: imagecache's default (5s).
	ImageProgressInterval time.Duration
	// PrivateImageCache: the entry's image cache neither shares downloads
	// with, nor copies published bases from, nor serves copies to the
	// other entries of the process; it downloads every cold image on its
	// own. Zero: the entries of a process whose hosts need the same cold
	// image at once share one download, and an entry going cold later
	// copies another entry's published base (of an image with a
	// configured SHA256) instead of downloading it; each host still
	// uploads, verifies and publishes its own base. Downloads and copies
	// are shared only among entries with the same HTTPClient (nil counts
	// as one shared client).
	PrivateImageCache bool
}

// ParseConfig reads one entry from a file's content: YAML, or JSON (which
// is YAML). Decoding is strict: an unknown key (a Go field name such as
// CallTimeout included: keys are camelCase), a key given twice, a value of
// the wrong type, a duration that is not a duration string ("30s"; a bare
// number would read as nanoseconds) and text that is not UTF-8 are errors,
// as is every rule Open enforces, except that the file need not name the
// key source nor the known_hosts source: a program may set them in code
// (Key from a Secret, say) before Open, which requires them. knownHosts is
// the text of a known_hosts file (in YAML a block: "knownHosts: |" with
// the lines indented below it); the other credential fields (Key,
// KeyPassphrase) cannot come from a file.
//
// Every problem is reported at once, Permanent, one *egressproxy.FieldError
// each, naming the key path as the file writes it (images.deb.sha256,
// machineTypes.small.vcpus) and its line. The Config is returned as
// written, without the defaults Open fills in, so marshalling it gives the
// file back (image URLs redacted).
func ParseConfig(data []byte) (Config, error) {
	root, err := parseYAML(data)
	if err != nil {
		return Config{}, errs.WithCode(errs.Permanent, fmt.Errorf("kvm2: invalid config: %w", err))
	}
	var d decoder
	var c Config
	if root != nil {
		d.decode(root, reflect.ValueOf(&c).Elem(), "")
	}
	d.checkFile(c, "")
	if err := d.err(); err != nil {
		return Config{}, err
	}
	return c, nil
}

// ParseEntries reads a file that lists several entries: a mapping whose
// key "entries" holds a list of entries, each read as ParseConfig reads
// one, and whose other keys are the program's own. rest receives them: a
// pointer to a struct whose fields are decoded as a Config's are (keys are
// the json tags, matched exactly; durations are strings; an unknown key
// is an error); nil when the file holds only entries. rest must not have
// a field for "entries".
//
// Every problem of the file is reported at once, Permanent, one
// *egressproxy.FieldError each, naming its key path with the entry's index
// (entries[2].images.deb.sha256) and its line: each entry's problems, two
// entries with the same name, no entries, and the problems of the
// program's keys (their decoding only: rest's values are the program's
// to check). The entries are returned as written, in file order.
func ParseEntries(data []byte, rest any) ([]Config, error) {
	rv, err := restValue(rest)
	if err != nil {
		return nil, err
	}
	root, err := parseYAML(data)
	if err != nil {
		return nil, errs.WithCode(errs.Permanent, fmt.Errorf("kvm2: invalid config: %w", err))
	}
	var d decoder
	var list *yaml.Node
	if root != nil && d.want(root, yaml.MappingNode, "") {
		list = d.splitEntries(root, rv)
	}
	cfgs := d.entries(list)
	if err := d.err(); err != nil {
		return nil, err
	}
	return cfgs, nil
}

// restValue checks ParseEntries' rest: nil, or a pointer to a struct
// without a field for "entries".
func restValue(rest any) (reflect.Value, error) {
	if rest == nil {
		return reflect.Value{}, nil
	}
	v := reflect.ValueOf(rest)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Elem().Kind() != reflect.Struct {
		return reflect.Value{}, errs.Errorf(errs.Permanent, "kvm2: ParseEntries: rest is a %T, want nil or a pointer to a struct", rest)
	}
	if _, ok := structFields(v.Elem().Type()).byKey["entries"]; ok {
		return reflect.Value{}, errs.Errorf(errs.Permanent, "kvm2: ParseEntries: rest (%T) has a field for \"entries\"; the entries are returned", rest)
	}
	return v.Elem(), nil
}

// splitEntries decodes the keys of the document other than "entries" into
// rest (when rest is the zero Value, the program has no keys of its own)
// and returns the entries' node.
func (d *decoder) splitEntries(root *yaml.Node, rest reflect.Value) *yaml.Node {
	var list *yaml.Node
	var others []pair
	for _, p := range d.pairs(root, "") {
		switch k := d.resolve(p.key); {
		case k.Kind != yaml.ScalarNode || k.Value != "entries":
			others = append(others, p)
		case list != nil:
			d.add("entries", k.Line, "", fmt.Sprintf("is given twice (first on line %d)", d.lineOf("entries")))
		default:
			d.saw("entries", k.Line)
			list = p.value
		}
	}
	if !rest.IsValid() {
		rest = reflect.ValueOf(&struct{}{}).Elem()
	}
	d.decodeStruct(others, rest, "", "entries")
	return list
}

// entries decodes and checks the entries' list.
func (d *decoder) entries(list *yaml.Node) []Config {
	if list == nil {
		if !d.reported("") {
			d.add("entries", 0, "", "is required: a list of entries, one per hypervisor")
		}
		return nil
	}
	if list = d.resolve(list); !d.want(list, yaml.SequenceNode, "entries") {
		return nil
	}
	if len(list.Content) == 0 {
		d.add("entries", list.Line, "", "must list at least one entry")
	}
	cfgs := make([]Config, len(list.Content))
	names := map[string]int{}
	for i, item := range list.Content {
		at := joinIndex("entries", i)
		d.saw(at, item.Line)
		d.decode(item, reflect.ValueOf(&cfgs[i]).Elem(), at)
		if j, dup := names[cfgs[i].Entry]; dup && cfgs[i].Entry != "" {
			field := joinKey(at, "entry")
			d.problems = append(d.problems, &errs.FieldError{Field: field, Value: cfgs[i].Entry, Line: d.lineOf(field),
				Rule: fmt.Sprintf("is also the name of entries[%d]: every entry needs its own", j)})
		} else if !dup {
			names[cfgs[i].Entry] = i
		}
		d.checkFile(cfgs[i], at)
	}
	return cfgs
}

// err returns the problems found, in the order of their lines, as one
// Permanent error; nil when there are none.
func (d *decoder) err() error {
	return invalid(d.problems)
}

// invalid joins problems, sorted by line (those without one last), into
// one Permanent error; nil when there are none.
func invalid(problems []*errs.FieldError) error {
	if len(problems) == 0 {
		return nil
	}
	sort.SliceStable(problems, func(i, j int) bool {
		li, lj := problems[i].Line, problems[j].Line
		return li != 0 && (lj == 0 || li < lj)
	})
	list := make([]error, len(problems))
	for i, p := range problems {
		list[i] = p
	}
	return errs.WithCode(errs.Permanent, fmt.Errorf("kvm2: invalid config: %w", errors.Join(list...)))
}

// String returns c in its marshalled form (JSON): image URLs redacted,
// credential fields absent. fmt's %v, %+v and %s use it, and %#v
// (GoString), so printing a Config never shows a secret.
func (c Config) String() string {
	b, err := json.Marshal(c)
	if err != nil {
		return "kvm2.Config{<" + errs.ClipMessage(err.Error()) + ">}"
	}
	return string(b)
}

// GoString is String for %#v.
func (c Config) GoString() string { return "kvm2.Config" + c.String() }

// MarshalLog gives logr sinks that do not use String (e.g. zapr) the
// marshalled form as a structured value.
func (c Config) MarshalLog() any {
	var m map[string]any
	if err := json.Unmarshal([]byte(c.String()), &m); err != nil {
		return c.String()
	}
	return m
}

// validate checks c as Open does and returns it with the defaults
// applied. The error is Permanent and joins one *errs.FieldError per
// broken rule, each naming the Go field path. hasSigner: Options.Signer
// is the key source.
func (c Config) validate(hasSigner bool) (Config, error) {
	if problems := c.check(true, hasSigner); len(problems) > 0 {
		return c, invalid(goFieldErrors(problems))
	}
	return c.withDefaults(), nil
}

// MarshalJSON writes c with durations as strings ("30s", zero left out)
// and KnownHosts as text.
func (c Config) MarshalJSON() ([]byte, error) {
	type plain Config
	d := func(v time.Duration) *duration.Duration {
		if v == 0 {
			return nil
		}
		return (*duration.Duration)(&v)
	}
	// The fields below shadow plain's of the same JSON names.
	return json.Marshal(struct {
		plain
		KnownHosts        string             `json:"knownHosts,omitempty"`
		TransferBudget    *duration.Duration `json:"transferBudget,omitempty"`
		ClaimTimeout      *duration.Duration `json:"claimTimeout,omitempty"`
		CallTimeout       *duration.Duration `json:"callTimeout,omitempty"`
		DialTimeout       *duration.Duration `json:"dialTimeout,omitempty"`
		KeepaliveInterval *duration.Duration `json:"keepaliveInterval,omitempty"`
	}{plain(c), string(c.KnownHosts), d(c.TransferBudget), d(c.ClaimTimeout), d(c.CallTimeout), d(c.DialTimeout), d(c.KeepaliveInterval)})
}

// UnmarshalJSON reads c as ParseConfig decodes a file, without the checks
// of Open's rules: strictly, durations as strings, KnownHosts as text. A
// problem names the key path below c, without a line. null leaves c as it
// is.
func (c *Config) UnmarshalJSON(b []byte) error {
	root, err := parseYAML(b)
	if err != nil {
		return errs.WithCode(errs.Permanent, fmt.Errorf("kvm2: invalid config: %w", err))
	}
	if root == nil || isNull(root) {
		return nil
	}
	var d decoder
	d.decode(root, reflect.ValueOf(c).Elem(), "")
	for _, p := range d.problems {
		p.Line = 0 // a line of the JSON value alone, not of its file
	}
	return d.err()
}
