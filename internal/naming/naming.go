package naming

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy/internal/errs"
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

// ValidateName checks a name (instance name, provider entry name) against
// the lowercase DNS-label rule that makes it a safe volume-name component:
// 1–63 characters of a–z, 0–9 and '-', starting and ending with a letter or
// digit, with no "--". field names the field in the error (a *FieldError,
// unclassed).
func ValidateName(field, name string) error {
	if name == "" {
		return &errs.FieldError{Field: field, Rule: "is required"}
	}
	if len(name) > MaxNameLen {
		return &errs.FieldError{Field: field, Value: name, Rule: fmt.Sprintf("must be at most %d characters", MaxNameLen)}
	}
	return checkShape(field, name, false)
}

func validateKey(field, key string) error {
	if len(key) > MaxImageKeyLen {
		return &errs.FieldError{Field: field, Value: key, Rule: fmt.Sprintf("must be at most %d characters", MaxImageKeyLen)}
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
			return &errs.FieldError{Field: field, Value: s, Rule: "may contain only " + allowed}
		}
	}
	if !isAlnum(s[0]) || !isAlnum(s[len(s)-1]) {
		return &errs.FieldError{Field: field, Value: s, Rule: "must start and end with a lowercase letter or digit"}
	}
	if strings.Contains(s, "--") {
		return &errs.FieldError{Field: field, Value: s, Rule: `must not contain "--"`}
	}
	return nil
}

func isAlnum(c byte) bool { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') }

func ValidateUID(uid string) error {
	if uid == "" {
		return &errs.FieldError{Field: "UID", Rule: "is required"}
	}
	if len(uid) > MaxUIDLen {
		return &errs.FieldError{Field: "UID", Value: uid, Rule: fmt.Sprintf("must be at most %d bytes", MaxUIDLen)}
	}
	if !utf8.ValidString(uid) {
		return &errs.FieldError{Field: "UID", Value: uid, Rule: "must be valid UTF-8"}
	}
	for _, r := range uid {
		if unicode.IsControl(r) {
			return &errs.FieldError{Field: "UID", Value: uid, Rule: "must not contain control characters"}
		}
	}
	return nil
}

// ValidateRef checks a Ref's Name and UID with the Spec rules, classed
// Permanent.
func ValidateRef(name, uid string) error {
	var bad []error
	if err := ValidateName("Name", name); err != nil {
		bad = append(bad, err)
	}
	if err := ValidateUID(uid); err != nil {
		bad = append(bad, err)
	}
	if len(bad) == 0 {
		return nil
	}
	return errs.WithCode(errs.Permanent, errors.Join(bad...))
}

// ValidateKey checks a key of a provider's catalogue (an image key, a
// machine type name) with the one rule every package applies: 1 to
// MaxImageKeyLen bytes of lowercase letters, digits, '.' and '-', starting
// and ending with a letter or digit, without "--" (the separator of volume
// names). An empty key is an error ("is required"); Spec.Validate accepts an
// empty ImageKey or MachineType itself, meaning the provider's default. The
// error is a *FieldError naming field.
func ValidateKey(field, key string) error {
	if key == "" {
		return &errs.FieldError{Field: field, Rule: "is required"}
	}
	return validateKey(field, key)
}
