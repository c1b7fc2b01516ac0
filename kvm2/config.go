package kvm2

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/crypto/ssh"
	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/duration"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// Defaults used for zero Config fields.
const (
	DefaultLibvirtSocket      = "/var/run/libvirt/libvirt-sock"
	DefaultLibvirtURI         = "qemu:///system"
	DefaultDomainType         = "qemu" // the fallback of a zero (automatic) DomainType on a host without KVM
	DefaultNetwork            = "default"
	DefaultMachineTypeName    = "small"
	DefaultCallTimeout        = 2 * time.Minute
	defaultMachineTypeVCPUs   = 1
	defaultMachineTypeMemory  = 512
	maxMachineTypeVCPUs       = 256
	minMachineTypeMemoryMiB   = 64
	maxMachineTypeMemoryMiB   = 1 << 22 // 4 TiB
	maxLibvirtObjectNameBytes = 255
)

// MinClaimTimeout is the shortest non-zero Config.ClaimTimeout: a claim
// is then refreshed every 2.5 s and given up after 5 s without a refresh.
// Much shorter would let one slow libvirt call cost a fetch, and leave
// little room for clock skew between the processes sharing a pool (they
// must agree to within ClaimTimeout/2).
const MinClaimTimeout = 10 * time.Second

// MachineType is the size of a VM.
type MachineType struct {
	// VCPUs is the number of virtual CPUs, 1–256.
	VCPUs int `json:"vcpus"`
	// MemoryMiB is the guest memory in MiB, at least 64.
	MemoryMiB int `json:"memoryMiB"`
}

// Config describes one provider entry: one hypervisor host reached over SSH
// and one libvirt storage pool on it. Every field documents its zero value.
// Open validates it (errors name the field and the rule) and touches nothing.
//
// Config is data an operator keeps in a file, a ConfigMap or a Secret: it
// marshals to JSON and YAML (sigs.k8s.io/yaml) with camelCase keys,
// durations as strings ("30s", duration.Duration), zero values that mean
// "the default" omitted. ParseConfig decodes one strictly. Secrets never
// appear in its marshalled form or its String: image URLs are redacted
// (imagecache.RedactURL) and credential fields are tagged `json:"-"`, so
// they are set in code (from a Secret), never from the file. docs/config.md
// shows every field with its default and rule.
type Config struct {
	// Entry is the provider entry name. It becomes part of volume and domain
	// names, so it must be a lowercase DNS label (naming.ValidateName:
	// 1–63 of a–z, 0–9, '-', alphanumeric at both ends, no "--"). Required.
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
	// KeyFile, Key, Signer and AgentSocket (Open names the fields when none
	// or several are set). Zero: one of the others. It is read on every dial
	// (a missing file is reported by Check as CredentialsUnavailable, not by
	// Open).
	KeyFile string `json:"keyFile,omitempty"`
	// KnownHostsFile is an OpenSSH known_hosts file pinning the host key.
	// Required: host key verification cannot be skipped.
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
	// Signer signs with a key the embedder holds (a hardware token, its own
	// agent client); it must be safe for concurrent use. It is not
	// marshalled. Zero: another key source.
	Signer ssh.Signer `json:"-"`
	// AgentSocket is the absolute path of an ssh-agent's unix socket (what
	// SSH_AUTH_SOCK names): each SSH dial opens its own agent connection,
	// offers every key the agent holds and closes it after the handshake.
	// Zero: another key source.
	AgentSocket string `json:"agentSocket,omitempty"`
	// KnownHosts is the content of a known_hosts file, for host keys held in
	// a ConfigMap or a Secret (base64 in JSON, as every []byte). Host keys
	// are pinned by exactly one of KnownHostsFile and KnownHosts; both accept
	// hashed names, "[host]:port", patterns, @cert-authority lines (host
	// certificates signed by that CA) and @revoked lines. Zero: use
	// KnownHostsFile.
	KnownHosts []byte `json:"knownHosts,omitempty"`
	// LibvirtSocket is the path of libvirtd's read-write unix socket on the
	// host. Zero: /var/run/libvirt/libvirt-sock.
	LibvirtSocket string `json:"libvirtSocket,omitempty"`
	// LibvirtURI is the connection URI sent to libvirtd. Zero: qemu:///system.
	LibvirtURI string `json:"libvirtURI,omitempty"`
	// Pool is the libvirt storage pool holding base images, overlays and
	// seeds. Required.
	Pool string `json:"pool"`

	// Images maps an image key (egressproxy.Spec.ImageKey) to the base image
	// the instance's overlay is backed by; package imagecache fetches,
	// verifies and publishes it in Pool. An Image's Key may be left empty
	// (it is set from the map key); when set it must equal the map key.
	// Zero: no images — Check works, Create fails Permanent.
	Images map[string]imagecache.Image `json:"images,omitempty"`
	// DefaultImage is used when a Spec names no image. Zero: the only key
	// when Images has one key; required when it has several.
	DefaultImage string `json:"defaultImage,omitempty"`
	// TransferBudget bounds one cold image fetch (see imagecache.Config).
	// Zero: imagecache's default (20m).
	TransferBudget time.Duration `json:"transferBudget,omitempty"`
	// ClaimTimeout is the image cache's claim timeout
	// (imagecache.Config.ClaimTimeout). A process fetching a base into
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

	// MachineTypes maps a machine type name (egressproxy.Spec.MachineType) to
	// its size. Zero: {"small": {VCPUs: 1, MemoryMiB: 512}}.
	MachineTypes map[string]MachineType `json:"machineTypes,omitempty"`
	// DefaultMachineType is used when a Spec names none. Zero: "small" when
	// MachineTypes is empty, the only key when it has one key; required when
	// it has several.
	DefaultMachineType string `json:"defaultMachineType,omitempty"`

	// Network is the libvirt network the VM's NIC joins. Zero: "default",
	// unless Bridge is set. Setting both is an error.
	Network string `json:"network,omitempty"`
	// Bridge is a host bridge the VM's NIC joins instead of a libvirt
	// network. Zero: use Network.
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
	// context has no deadline. Zero: 2m. A call it ends is Transient (the
	// caller's own deadline is DeadlineExceeded); so is a dial that
	// DialTimeout ends.
	CallTimeout time.Duration `json:"callTimeout,omitempty"`
	// DialTimeout bounds the SSH dial and handshake. Zero: sshconn's default
	// (10s).
	DialTimeout time.Duration `json:"dialTimeout,omitempty"`
	// KeepaliveInterval and KeepaliveCount tune SSH liveness. Zero:
	// sshconn's defaults (5s, 3).
	KeepaliveInterval time.Duration `json:"keepaliveInterval,omitempty"`
	KeepaliveCount    int           `json:"keepaliveCount,omitempty"`
}

// Options are optional collaborators. A nil *Options is valid.
type Options struct {
	// Logger receives the provider's log lines. Zero value: discard. The
	// provider never writes to stdout or stderr.
	Logger logr.Logger
	// TracerProvider creates a span per backend call. Nil: no-op.
	TracerProvider trace.TracerProvider
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

// ParseConfig decodes one entry from YAML or JSON (JSON is YAML) strictly
// and validates it as Open does. An unknown or duplicate key, a value of the
// wrong type and a duration written as a bare number (it would be read as
// nanoseconds) are errors that name the key; validation errors name the Go
// field and the rule, one *errs.FieldError each. Every error is
// Permanent. The Config is returned as written, without the defaults Open
// fills in, so marshalling it gives the file back (image URLs redacted).
// Credential values (Key, KeyPassphrase, Signer, KnownHosts) cannot come
// from the file: set them before Open. With CredentialsLater the file may
// leave out the key source, the known_hosts source or both (an operator
// fills them from a Secret; Open requires them); the sources a file does
// give (keyFile, agentSocket, knownHostsFile) are checked either way.
func ParseConfig(data []byte, opts ...ParseOption) (Config, error) {
	var o parseOptions
	for _, opt := range opts {
		opt(&o)
	}
	var c Config
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		return Config{}, errs.WithCode(errs.Permanent, fmt.Errorf("kvm2: invalid config: %w", decodeError(err)))
	}
	if _, err := c.validateAs(!o.credentialsLater); err != nil {
		return Config{}, err
	}
	return c, nil
}

// ParseOption changes what ParseConfig requires.
type ParseOption func(*parseOptions)

type parseOptions struct{ credentialsLater bool }

// CredentialsLater makes ParseConfig accept an entry without a key source
// or without a known_hosts source: the program sets them (Key and
// KnownHosts from a Secret, say) before Open, which requires them.
func CredentialsLater() ParseOption { return func(o *parseOptions) { o.credentialsLater = true } }

// decodeError turns a decoding error that names a key into a
// *errs.FieldError; other errors (syntax) are returned as they are.
func decodeError(err error) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) && te.Field != "" {
		return fieldErr(te.Field, "", "got "+te.Value+", want "+te.Type.String())
	}
	const unknown = "json: unknown field "
	msg := err.Error()
	if i := strings.Index(msg, unknown); i >= 0 {
		if name, qerr := strconv.Unquote(msg[i+len(unknown):]); qerr == nil {
			return fieldErr(name, "", "is not a field of the config (keys are camelCase, see docs/config.md)")
		}
	}
	return err
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

// fieldErr returns a *errs.FieldError. The value is given as is: the
// error's text quotes it escaped and bounded (errs.Quote).
func fieldErr(field, value, rule string) error {
	return &errs.FieldError{Field: field, Value: value, Rule: rule}
}

// validateCredentials checks the key and known_hosts sources: exactly one
// of each (at most one when require is false: ParseConfig leaves absent
// sources to the embedder), a passphrase only for a key it can decrypt. No
// FieldError carries a secret: Value names a path at most.
func (c Config) validateCredentials(require bool) error {
	var problems []error
	oneOf := func(names []string, set []bool, missing, rule string) {
		var given []string
		for i, n := range names {
			if set[i] {
				given = append(given, n)
			}
		}
		switch {
		case len(given) == 0 && require:
			problems = append(problems, fieldErr(missing, "", rule))
		case len(given) > 1:
			for _, g := range given {
				var others []string
				for _, o := range given {
					if o != g {
						others = append(others, o)
					}
				}
				problems = append(problems, fieldErr(g, "", "set exactly one of "+strings.Join(names, ", ")+
					" (also set: "+strings.Join(others, ", ")+")"))
			}
		}
	}
	oneOf([]string{"KeyFile", "Key", "Signer", "AgentSocket"},
		[]bool{c.KeyFile != "", len(c.Key) > 0, c.Signer != nil, c.AgentSocket != ""},
		"KeyFile", "a client key is required: set one of KeyFile, Key, Signer, AgentSocket")
	if len(c.KeyPassphrase) > 0 && c.KeyFile == "" && len(c.Key) == 0 {
		problems = append(problems, fieldErr("KeyPassphrase", "", "applies only to KeyFile or Key"))
	}
	if c.AgentSocket != "" && !filepath.IsAbs(c.AgentSocket) {
		problems = append(problems, fieldErr("AgentSocket", c.AgentSocket, "must be an absolute path (the agent's unix socket)"))
	}
	oneOf([]string{"KnownHostsFile", "KnownHosts"},
		[]bool{c.KnownHostsFile != "", len(c.KnownHosts) > 0},
		"KnownHostsFile", "is required, or KnownHosts (host key verification cannot be skipped)")
	if len(c.KnownHosts) > 0 && !hasKnownHostsLine(c.KnownHosts) {
		problems = append(problems, fieldErr("KnownHosts", "", "must contain at least one valid known_hosts line"))
	}
	return errors.Join(problems...)
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

// keyField names the entry of a map field, e.g. MachineTypes["small"], with
// the key quoted escaped and bounded (errs.Quote): a key is caller input.
func keyField(field, key string) string { return field + "[" + errs.Quote(key) + "]" }

// validate checks c and returns it with defaults applied. The error is classed
// Permanent and joins one *errs.FieldError per violation.
func (c Config) validate() (Config, error) { return c.validateAs(true) }

// validateAs is validate; with requireCredentials false a Config without a
// key source or without a known_hosts source passes (ParseConfig).
func (c Config) validateAs(requireCredentials bool) (Config, error) {
	var problems []error
	add := func(err error) {
		if err != nil {
			problems = append(problems, err)
		}
	}
	add(naming.ValidateName("Entry", c.Entry))
	add(naming.ValidateName("Owner", c.Owner))

	if c.Address == "" {
		add(fieldErr("Address", "", "is required (host:port of sshd)"))
	} else if host, port, err := net.SplitHostPort(c.Address); err != nil {
		add(fieldErr("Address", c.Address, "must be host:port"))
	} else if host == "" {
		add(fieldErr("Address", c.Address, "host must not be empty"))
	} else if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		add(fieldErr("Address", c.Address, "port must be a number in 1-65535"))
	}
	if c.User == "" {
		add(fieldErr("User", "", "is required"))
	} else if strings.ContainsAny(c.User, " \t\r\n@:/") {
		add(fieldErr("User", c.User, "must not contain spaces, '@', ':' or '/'"))
	}
	add(c.validateCredentials(requireCredentials))
	if c.LibvirtSocket == "" {
		c.LibvirtSocket = DefaultLibvirtSocket
	} else if !path.IsAbs(c.LibvirtSocket) {
		add(fieldErr("LibvirtSocket", c.LibvirtSocket, "must be an absolute path on the host"))
	}
	if c.LibvirtURI == "" {
		c.LibvirtURI = DefaultLibvirtURI
	} else if !strings.Contains(c.LibvirtURI, "://") {
		add(fieldErr("LibvirtURI", c.LibvirtURI, `must be a libvirt URI such as "qemu:///system"`))
	}
	add(validateObjectName("Pool", c.Pool, true))

	// Machine types.
	if len(c.MachineTypes) == 0 {
		c.MachineTypes = map[string]MachineType{DefaultMachineTypeName: {VCPUs: defaultMachineTypeVCPUs, MemoryMiB: defaultMachineTypeMemory}}
	} else {
		mts := make(map[string]MachineType, len(c.MachineTypes))
		for _, name := range sortedKeys(c.MachineTypes) {
			mt := c.MachineTypes[name]
			field := keyField("MachineTypes", name)
			if err := validateKey(field, name); err != nil {
				add(err)
				continue
			}
			if mt.VCPUs < 1 || mt.VCPUs > maxMachineTypeVCPUs {
				add(fieldErr(field+".VCPUs", strconv.Itoa(mt.VCPUs), fmt.Sprintf("must be 1-%d", maxMachineTypeVCPUs)))
			}
			if mt.MemoryMiB < minMachineTypeMemoryMiB || mt.MemoryMiB > maxMachineTypeMemoryMiB {
				add(fieldErr(field+".MemoryMiB", strconv.Itoa(mt.MemoryMiB), fmt.Sprintf("must be %d-%d", minMachineTypeMemoryMiB, maxMachineTypeMemoryMiB)))
			}
			mts[name] = mt
		}
		c.MachineTypes = mts
	}
	if c.DefaultMachineType == "" {
		switch {
		case len(c.MachineTypes) == 1:
			for k := range c.MachineTypes {
				c.DefaultMachineType = k
			}
		default:
			add(fieldErr("DefaultMachineType", "", "is required when MachineTypes has several entries"))
		}
	} else if _, ok := c.MachineTypes[c.DefaultMachineType]; !ok {
		add(fieldErr("DefaultMachineType", c.DefaultMachineType, "must be a key of MachineTypes"))
	}

	// Images (see images.go).
	c, problems = c.validateImages(problems)

	// Network.
	switch {
	case c.Network != "" && c.Bridge != "":
		add(fieldErr("Bridge", c.Bridge, "must be empty when Network is set (one NIC: a libvirt network or a bridge)"))
	case c.Bridge != "":
		if len(c.Bridge) > 15 || strings.ContainsAny(c.Bridge, " /\t\r\n") {
			add(fieldErr("Bridge", c.Bridge, "must be an interface name (at most 15 characters, no spaces or '/')"))
		}
	default:
		if c.Network == "" {
			c.Network = DefaultNetwork
		}
		add(validateObjectName("Network", c.Network, true))
	}

	switch c.DomainType {
	case "", domainTypeQEMU, domainTypeKVM: // "": automatic (accel.go)
	default:
		add(fieldErr("DomainType", c.DomainType, `must be "kvm", "qemu", or empty (automatic)`))
	}

	if c.Kernel != "" && !path.IsAbs(c.Kernel) {
		add(fieldErr("Kernel", c.Kernel, "must be an absolute path on the host"))
	}
	if c.Initrd != "" {
		if c.Kernel == "" {
			add(fieldErr("Initrd", c.Initrd, "requires Kernel"))
		} else if !path.IsAbs(c.Initrd) {
			add(fieldErr("Initrd", c.Initrd, "must be an absolute path on the host"))
		}
	}
	if c.Cmdline != "" && c.Kernel == "" {
		add(fieldErr("Cmdline", c.Cmdline, "requires Kernel"))
	}

	if c.ConsoleLogDir != "" && !path.IsAbs(c.ConsoleLogDir) {
		add(fieldErr("ConsoleLogDir", c.ConsoleLogDir, "must be an absolute path on the host"))
	}
	if c.TransferBudget < 0 {
		add(fieldErr("TransferBudget", c.TransferBudget.String(), "must not be negative (zero means the imagecache default)"))
	}
	if c.ClaimTimeout != 0 && c.ClaimTimeout < MinClaimTimeout {
		add(fieldErr("ClaimTimeout", c.ClaimTimeout.String(), fmt.Sprintf("must be zero (imagecache's default, 2m) or at least %s (the claim is refreshed every ClaimTimeout/4)", MinClaimTimeout)))
	}
	if c.CallTimeout < 0 {
		add(fieldErr("CallTimeout", c.CallTimeout.String(), "must not be negative (zero means 2m)"))
	} else if c.CallTimeout == 0 {
		c.CallTimeout = DefaultCallTimeout
	}
	if c.DialTimeout < 0 {
		add(fieldErr("DialTimeout", c.DialTimeout.String(), "must not be negative (zero means the sshconn default)"))
	}
	if c.KeepaliveInterval < 0 {
		add(fieldErr("KeepaliveInterval", c.KeepaliveInterval.String(), "must not be negative (zero means the sshconn default)"))
	}
	if c.KeepaliveCount < 0 {
		add(fieldErr("KeepaliveCount", strconv.Itoa(c.KeepaliveCount), "must not be negative (zero means the sshconn default)"))
	}

	if len(problems) == 0 {
		return c, nil
	}
	return c, errs.WithCode(errs.Permanent, fmt.Errorf("kvm2: invalid config: %w", errors.Join(problems...)))
}

// validateObjectName checks a libvirt object name (pool, network): no '/',
// no control characters, at most 255 bytes.
func validateObjectName(field, name string, required bool) error {
	if name == "" {
		if required {
			return fieldErr(field, "", "is required")
		}
		return nil
	}
	if len(name) > maxLibvirtObjectNameBytes {
		return fieldErr(field, name, fmt.Sprintf("is %d bytes, at most %d allowed", len(name), maxLibvirtObjectNameBytes))
	}
	for _, r := range name {
		if r < 0x20 || r == 0x7f || r == '/' {
			return fieldErr(field, name, "must not contain '/' or control characters")
		}
	}
	return nil
}

// validateKey checks an image key or machine type name, a map key, with the
// one key rule (naming.ValidateKey). field already quotes the key (keyField), so the error does not
// repeat it as its value.
func validateKey(field, key string) error {
	var fe *errs.FieldError
	if err := naming.ValidateKey(field, key); errors.As(err, &fe) {
		return fieldErr(field, "", fe.Rule)
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// MarshalJSON writes c with durations as strings ("30s", zero left out).
func (c Config) MarshalJSON() ([]byte, error) {
	type plain Config
	d := func(v time.Duration) *duration.Duration {
		if v == 0 {
			return nil
		}
		return (*duration.Duration)(&v)
	}
	// The duration fields below shadow plain's of the same JSON names.
	return json.Marshal(struct {
		plain
		TransferBudget    *duration.Duration `json:"transferBudget,omitempty"`
		ClaimTimeout      *duration.Duration `json:"claimTimeout,omitempty"`
		CallTimeout       *duration.Duration `json:"callTimeout,omitempty"`
		DialTimeout       *duration.Duration `json:"dialTimeout,omitempty"`
		KeepaliveInterval *duration.Duration `json:"keepaliveInterval,omitempty"`
	}{plain(c), d(c.TransferBudget), d(c.ClaimTimeout), d(c.CallTimeout), d(c.DialTimeout), d(c.KeepaliveInterval)})
}

// UnmarshalJSON reads c strictly (an unknown key is an error), durations
// as strings in time.ParseDuration syntax ("30s"; a bare number, which
// would read as nanoseconds, is refused).
func (c *Config) UnmarshalJSON(b []byte) error {
	type plain Config
	v := struct {
		*plain
		TransferBudget    *duration.Duration `json:"transferBudget,omitempty"`
		ClaimTimeout      *duration.Duration `json:"claimTimeout,omitempty"`
		CallTimeout       *duration.Duration `json:"callTimeout,omitempty"`
		DialTimeout       *duration.Duration `json:"dialTimeout,omitempty"`
		KeepaliveInterval *duration.Duration `json:"keepaliveInterval,omitempty"`
	}{(*plain)(c), (*duration.Duration)(&c.TransferBudget), (*duration.Duration)(&c.ClaimTimeout),
		(*duration.Duration)(&c.CallTimeout), (*duration.Duration)(&c.DialTimeout), (*duration.Duration)(&c.KeepaliveInterval)}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	return dec.Decode(&v)
}
