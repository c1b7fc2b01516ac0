package kvm2

import (
	"errors"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// validateImages checks Images and DefaultImage and fills image keys.
func (c Config) validateImages(problems []error) (Config, []error) {
	add := func(err error) { problems = append(problems, err) }
	imgs := make(map[string]imagecache.Image, len(c.Images))
	for _, key := range sortedKeys(c.Images) {
		img := c.Images[key]
		field := keyField("Images", key)
		if err := validateKey(field, key); err != nil {
			add(err)
			continue
		}
		if img.Key == "" {
			img.Key = key
		} else if img.Key != key {
			add(fieldErr(field+".Key", img.Key, "must be empty or equal the map key"))
			continue
		}
		if err := img.Validate(); err != nil {
			for _, e := range flatten(err) {
				var fe *errs.FieldError
				if errors.As(e, &fe) {
					add(&errs.FieldError{Field: field + "." + fe.Field, Value: fe.Value, Rule: fe.Rule})
				} else {
					add(fieldErr(field, "", e.Error()))
				}
			}
			continue
		}
		imgs[key] = img
	}
	c.Images = imgs
	switch {
	case c.DefaultImage != "":
		if _, ok := c.Images[c.DefaultImage]; !ok {
			add(fieldErr("DefaultImage", c.DefaultImage, "must be a key of Images"))
		}
	case len(c.Images) == 1:
		for k := range c.Images {
			c.DefaultImage = k
		}
	case len(c.Images) > 1:
		add(fieldErr("DefaultImage", "", "is required when Images has several entries"))
	}
	return c, problems
}

// flatten returns the leaves of an errors.Join tree (looking through
// single-error wrappers such as a provider class).
func flatten(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []error
		for _, e := range j.Unwrap() {
			out = append(out, flatten(e)...)
		}
		return out
	}
	if u := errors.Unwrap(err); u != nil {
		if _, ok := u.(interface{ Unwrap() []error }); ok {
			return flatten(u)
		}
	}
	return []error{err}
}
