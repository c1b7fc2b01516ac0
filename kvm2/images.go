package kvm2

// validateImages checks the image fields of c (added with the lifecycle, when
// package imagecache is available). Until then there is nothing to check.
func (c Config) validateImages(errs []error) (Config, []error) { return c, errs }
