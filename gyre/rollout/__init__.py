"""Engine protocol (SGLang-native HTTP), embedded CPU engine, SGLang adapter, weight publication."""
