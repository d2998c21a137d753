"""flash"""
