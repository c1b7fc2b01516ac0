package provider

// ValidateKey checks a key of a provider's catalogue (an image key, a
// machine type name) with the one rule every package applies: 1 to
// MaxImageKeyLen bytes of lowercase letters, digits, '.' and '-', starting
// and ending with a letter or digit, without "--" (the separator of volume
// names). An empty key is an error ("is required"); Spec.Validate accepts an
// empty ImageKey or MachineType itself, meaning the provider's default. The
// error is a *FieldError naming field.
func ValidateKey(field, key string) error {
	if key == "" {
		return &FieldError{Field: field, Rule: "is required"}
	}
	return validateKey(field, key)
}
