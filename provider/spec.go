package provider

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

const (
	// MaxNameLen is the longest instance or entry name.
	MaxNameLen = 63
	// MaxUIDLen is the longest UID, in bytes.
	MaxUIDLen = 128
	// MaxImageKeyLen is the longest image key.
	MaxImageKeyLen = 63
	// MaxUserDataBytes is the largest accepted cloud-init user-data.
	MaxUserDataBytes = 64 << 10
	// DefaultPort is the proxy port used when Spec.Port is zero.
	DefaultPort = 3128
)

// Spec describes an instance to create.
type Spec struct {
	// Name of the instance: a lowercase DNS label (1–63 of a–z, 0–9, '-',
	// starting and ending with a letter or digit, no "--"), so it is a safe
	// component of backend object and volume names. Required.
	Name string
	// UID is the instance identity Create is idempotent on (e.g. a
	// Kubernetes object UID). 1–128 bytes of valid UTF-8 without control
	// characters. Required.
	UID string
	// Port the proxy listens on in the instance. Zero means DefaultPort;
	// otherwise 1–65535.
	Port int
	// ImageKey selects the base image from the provider's configured
	// images: 1–63 of a–z, 0–9, '.', '-', starting and ending with a letter
	// or digit, no "--". Empty means the provider's default image.
	ImageKey string
	// MachineType selects vCPUs and memory from the provider's configured
	// machine types; same shape as ImageKey. Empty means the provider's
	// default.
	MachineType string
	// UserData is the cloud-init user-data given to the instance, at most
	// MaxUserDataBytes. Optional.
	UserData string
}

// FieldError is a bad-input error naming the field and the rule it broke.
// It is always classed Permanent by Validate. Its text is
//
//	invalid <Field> <Quote(Value)>: <Rule>
//
// (without the value when Value is empty), clipped to MaxErrorText bytes:
// Value is printed escaped and bounded by Quote, so any input is safe to
// put in it as given.
type FieldError struct {
	Field string
	Value string // the offending value as given; Error quotes and bounds it
	Rule  string
}

func (e *FieldError) Error() string {
	if e.Value == "" {
		return ClipMessage("invalid " + e.Field + ": " + e.Rule)
	}
	return ClipMessage("invalid " + e.Field + " " + Quote(e.Value) + ": " + e.Rule)
}

// Validate checks every field and returns all violations joined (each a
// *FieldError), classed Permanent; nil when the spec is valid.
func (s Spec) Validate() error {
	var errs []error
	if err := ValidateName("Name", s.Name); err != nil {
		errs = append(errs, err)
	}
	if err := validateUID(s.UID); err != nil {
		errs = append(errs, err)
	}
	if s.Port < 0 || s.Port > 65535 {
		errs = append(errs, &FieldError{Field: "Port", Value: strconv.Itoa(s.Port), Rule: "must be 0 (default 3128) or 1-65535"})
	}
	if s.ImageKey != "" {
		if err := validateKey("ImageKey", s.ImageKey); err != nil {
			errs = append(errs, err)
		}
	}
	if s.MachineType != "" {
		if err := validateKey("MachineType", s.MachineType); err != nil {
			errs = append(errs, err)
		}
	}
	if len(s.UserData) > MaxUserDataBytes {
		errs = append(errs, &FieldError{Field: "UserData", Rule: fmt.Sprintf("is %d bytes, at most %d allowed", len(s.UserData), MaxUserDataBytes)})
	}
	if len(errs) == 0 {
		return nil
	}
	return WithCode(Permanent, errors.Join(errs...))
}

// EffectivePort returns s.Port, or DefaultPort when it is zero.
func (s Spec) EffectivePort() int {
	if s.Port == 0 {
		return DefaultPort
	}
	return s.Port
}

// specDigestDomain starts the hashed encoding of Digest; a future encoding
// gets another domain string (and the digest another prefix).
const specDigestDomain = "egressproxy.dev/spec/v1"

// Digest returns a stable digest of the spec: "sha256:" and 64 lowercase
// hex digits, the SHA-256 of a versioned encoding in which every field is
// length-prefixed (so no two specs share an encoding): Name, UID,
// EffectivePort, ImageKey, MachineType, UserData, in that order. Port is
// normalised (0 and DefaultPort digest alike); nothing else is: an empty
// ImageKey or MachineType (the provider's default) digests differently
// from the key it resolves to today, since the provider's default may
// change. The value depends only on the spec, never on the process, the
// platform or the release: providers record it at creation
// (Instance.SpecDigest) and compare it on Create (ErrSpecConflict). It is
// not a secret-keeping device: it only fingerprints the spec.
func (s Spec) Digest() string {
	h := sha256.New()
	var n [8]byte
	put := func(v string) {
		binary.BigEndian.PutUint64(n[:], uint64(len(v)))
		h.Write(n[:])
		h.Write([]byte(v))
	}
	put(specDigestDomain)
	for _, v := range []string{s.Name, s.UID, strconv.Itoa(s.EffectivePort()), s.ImageKey, s.MachineType, s.UserData} {
		put(v)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// Ref returns the Ref of the instance the spec describes.
func (s Spec) Ref() Ref { return Ref{Name: s.Name, UID: s.UID} }

// ValidateName checks a name (instance name, provider entry name) against
// the lowercase DNS-label rule that makes it a safe volume-name component:
// 1–63 characters of a–z, 0–9 and '-', starting and ending with a letter or
// digit, with no "--". field names the field in the error (a *FieldError,
// unclassed).
func ValidateName(field, name string) error {
	if name == "" {
		return &FieldError{Field: field, Rule: "is required"}
	}
	if len(name) > MaxNameLen {
		return &FieldError{Field: field, Value: name, Rule: fmt.Sprintf("must be at most %d characters", MaxNameLen)}
	}
	return checkShape(field, name, false)
}

func validateKey(field, key string) error {
	if len(key) > MaxImageKeyLen {
		return &FieldError{Field: field, Value: key, Rule: fmt.Sprintf("must be at most %d characters", MaxImageKeyLen)}
	}
	return checkShape(field, key, true)
}

func checkShape(field, s string, dots bool) error {
	allowed := "lowercase letters, digits and '-'"
	if dots {
		allowed = "lowercase letters, digits, '.' and '-'"
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		ok := (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || (dots && c == '.')
		if !ok {
			return &FieldError{Field: field, Value: s, Rule: "may contain only " + allowed}
		}
	}
	if !isAlnum(s[0]) || !isAlnum(s[len(s)-1]) {
		return &FieldError{Field: field, Value: s, Rule: "must start and end with a lowercase letter or digit"}
	}
	if strings.Contains(s, "--") {
		return &FieldError{Field: field, Value: s, Rule: `must not contain "--"`}
	}
	return nil
}

func isAlnum(c byte) bool { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') }

func validateUID(uid string) error {
	if uid == "" {
		return &FieldError{Field: "UID", Rule: "is required"}
	}
	if len(uid) > MaxUIDLen {
		return &FieldError{Field: "UID", Value: uid, Rule: fmt.Sprintf("must be at most %d bytes", MaxUIDLen)}
	}
	if !utf8.ValidString(uid) {
		return &FieldError{Field: "UID", Value: uid, Rule: "must be valid UTF-8"}
	}
	for _, r := range uid {
		if unicode.IsControl(r) {
			return &FieldError{Field: "UID", Value: uid, Rule: "must not contain control characters"}
		}
	}
	return nil
}

// ValidateRef checks a Ref's Name and UID with the Spec rules, classed
// Permanent.
func ValidateRef(r Ref) error {
	var errs []error
	if err := ValidateName("Name", r.Name); err != nil {
		errs = append(errs, err)
	}
	if err := validateUID(r.UID); err != nil {
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return nil
	}
	return WithCode(Permanent, errors.Join(errs...))
}

func joinHostPort(ip string, port int) string { return net.JoinHostPort(ip, strconv.Itoa(port)) }

// FieldErrors returns every *FieldError in err's tree (through %w wraps,
// errors.Join and *Error), in order: the violations a validation error
// reports all at once, for an embedder that shows them per field (a
// condition, an event, a form). It returns nil when err has none.
func FieldErrors(err error) []*FieldError {
	var out []*FieldError
	var walk func(error)
	walk = func(err error) {
		switch e := err.(type) {
		case nil:
			return
		case *FieldError:
			out = append(out, e)
		}
		switch e := err.(type) {
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				walk(inner)
			}
		case interface{ Unwrap() error }:
			walk(e.Unwrap())
		}
	}
	walk(err)
	return out
}
